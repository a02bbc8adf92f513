"""Context parallelism for a qkv model: every attention module's ``attention_fn`` becomes distributed
attention over the ranks of a group, so the model runs on this rank's shard of a long sequence.

Everything else in the model (embeddings, norms, MLPs, projections) is per token and runs on the shard
unchanged; RoPE rotates by the *global* position ids passed with the shard; masks built from those positions
become masks over the global sequence. A training step on W ranks then gives the single-process loss (sum of
the ranks' shares) and gradients (all-reduced with :meth:`ContextParallel.all_reduce_gradients`); a prefill
gives the same logits, sharded.
"""

from __future__ import annotations

import torch

from .. import masks
from .._attention import attention as _local_attention
from ..masks.sequence import Positions
from ..mods.base import ScoreMod
from ..nn.protocol import attention_modules
from ..pos.relative import RelativePositionMod
from .api import attention
from .exchange import CommLog, Exchange
from .groups import UspGroups
from .sharding import layout, shard, unshard, world_and_rank

__all__ = ["ContextParallel", "context_parallel"]


class ContextParallel:
    """The handle :func:`context_parallel` returns: shards inputs, runs the model, reduces gradients.

    Call it like the model on this rank's shard of token ids: ``cp(ids_local)`` passes the global position
    ids of the shard (``positions=`` to override, e.g. packed documents restarting at 0).
    """

    def __init__(self, model: torch.nn.Module, group, scheme: str, timeout: float | None, log: CommLog | None,
                 backend: str) -> None:
        self.model, self.group, self.scheme, self.timeout, self.log = model, group, scheme, timeout, log
        self.backend = backend
        self.world, self.rank = world_and_rank(group)
        found = attention_modules(model)
        if not found:
            raise TypeError(f"context_parallel: {type(model).__name__} has no attention module with an attention_fn "
                            "hook (qkv.nn.protocol.AttentionModule); qkv's decoder (qkv.nn.DecoderLM) has one per "
                            "layer")
        hookless = [f"{name or 'the model'} ({type(m).__name__})" for name, m in found if m.attention_fn is None]
        if hookless:
            raise TypeError(f"context_parallel: {', '.join(hookless)} computes no softmax attention (attention_fn is "
                            "None), so it cannot be distributed by swapping its operator; its shard would attend "
                            "within the shard only")
        self.hosts = [m for _, m in found]
        self._saved = [m.attention_fn for m in self.hosts]
        self._gathered: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # within one __call__
        for m in self.hosts:
            m.attention_fn = self._attention

    @property
    def _pg(self):
        return self.group.parent if isinstance(self.group, UspGroups) else self.group

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a global (B, N, ...) tensor (token ids, labels, positions)."""
        return shard(x, scheme=self.scheme, group=self.group, dim=dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's part (a collective), e.g. logits (B, N, V)."""
        return unshard(x_local, scheme=self.scheme, group=self.group, dim=dim, timeout=self.timeout)

    def positions(self, n_local: int, device=None) -> torch.Tensor:
        """Global position ids (n_local,) of this rank's shard of a sequence of ``n_local * W`` tokens."""
        return layout(self.scheme, n_local * self.world, self.world).index[self.rank].to(device)

    def __call__(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None, **kwargs):
        if positions is None:
            positions = self.positions(input_ids.shape[1], input_ids.device)
        # Within one forward every layer sees the same position ids: gather them once. (Every rank runs the
        # same layers on the same ids, so every rank finds the same entries and the collectives stay paired.)
        self._gathered = []
        try:
            return self.model(input_ids, positions=positions, **kwargs)
        finally:
            self._gathered = None

    def all_reduce_gradients(self) -> None:
        """Sum every parameter's gradient across the ranks (one all-reduce of a flat float32 buffer)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1).to(torch.float32) for p in params])
        Exchange(self._pg, self.scheme, self.timeout, self.log, phase="gradients").all_reduce(flat, "parameters")
        at = 0
        for p in params:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
            at += p.numel()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (e.g. the loss shares), not differentiable."""
        out = x.detach().clone()
        return Exchange(self._pg, self.scheme, self.timeout, self.log, phase="loss").all_reduce(out, "value")

    def restore(self) -> None:
        """Put the original ``attention_fn`` back on every module."""
        for m, fn in zip(self.hosts, self._saved):
            m.attention_fn = fn

    def _global_positions(self, local: torch.Tensor) -> torch.Tensor:
        """(B or 1, N) global position ids in global order, from every rank's (B or 1, n) local ids."""
        for seen, out in self._gathered or ():
            if seen is local or (seen.shape == local.shape and torch.equal(seen, local)):
                return out
        parts = Exchange(self._pg, self.scheme, self.timeout, self.log, phase="positions").all_gather(
            local.contiguous(), "position ids")
        lay = layout(self.scheme, local.shape[-1] * self.world, self.world)
        out = torch.empty(local.shape[0], lay.n_global, dtype=local.dtype, device=local.device)
        out[:, torch.cat(lay.index).to(local.device)] = torch.cat(parts, dim=-1)
        if self._gathered is not None:
            self._gathered.append((local, out))
        return out

    def _global_mod(self, mod: ScoreMod) -> ScoreMod:
        """A modifier that read this shard's position ids (ALiBi at explicit positions) reads the global ones."""
        if isinstance(mod, RelativePositionMod) and mod.qp is not None:
            return RelativePositionMod(mod.term, q_positions=self._global_positions(mod.qp),
                                       kv_positions=self._global_positions(mod.kp), tensors=mod.tensors(),
                                       name=mod.name)
        return mod

    def _attention(self, q, k, v, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False,
                   dropout_p: float = 0.0, generator=None, **kwargs):
        if kwargs:
            raise TypeError(f"context_parallel: distributed attention does not take {sorted(kwargs)}")
        if dropout_p:
            raise ValueError(f"context_parallel: attention dropout (dropout_p={dropout_p}) is not supported: its "
                             "pattern is drawn per block and would differ from one process's; set the model's "
                             "attention dropout to 0 (model.eval() for the modules that drop only in training)")
        if q.shape[2] != k.shape[2]:
            raise ValueError("context_parallel: runs prefill and training steps (queries and keys of the same "
                             f"shard); got {q.shape[2]} queries and {k.shape[2]} keys (a decode step with a cache); "
                             "restore() the model for cached generation")
        if isinstance(mask, Positions):  # built from this shard's position ids: make it global
            qp, kp = self._global_positions(mask.qp), self._global_positions(mask.kp)
            mask = masks.positions(qp, kp, causal=mask.causal, window=mask.window)
        if isinstance(score_mod, (list, tuple)):
            score_mod = [self._global_mod(m) for m in score_mod]
        elif score_mod is not None:
            score_mod = self._global_mod(score_mod)
        # Every block must return its log-sum-exp, so the module's own choice (e.g. SDPA for decoding) is not
        # taken: blocks run on the backend given to context_parallel.
        backend = self.backend
        if self.world == 1:
            return _local_attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, backend=backend,
                                    return_lse=return_lse)
        return attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, scheme=self.scheme, group=self.group,
                         return_lse=return_lse, timeout=self.timeout, backend=backend, log=self.log)


def context_parallel(model: torch.nn.Module, group=None, *, scheme: str = "zigzag", timeout: float | None = None,
                     log: CommLog | None = None, backend: str = "auto") -> ContextParallel:
    """Make ``model`` run context-parallel over ``group``: swap every attention module's ``attention_fn``.

    Args:
        model: a qkv model whose attention modules expose ``attention_fn`` (qkv's decoder).
        group: process group (default: the world), or :func:`usp_groups` for ``scheme="usp"``.
        scheme: any of :data:`qkv.distributed.SCHEMES`; ``zigzag`` balances causal work.
        timeout: seconds any collective may wait.
        log: a :class:`CommLog` recording every collective of the model's steps.
        backend: the qkv backend of each block (default ``"auto"``; the modules' own choices are not used,
            since every block must return its log-sum-exp).

    Returns:
        A :class:`ContextParallel`; ``restore()`` undoes the swap.

    Example:
        >>> # cp = context_parallel(model, scheme="zigzag")
        >>> # logits = cp(cp.shard(ids)).logits               # (B, N / W, V) of this rank's tokens
        >>> # loss = cross_entropy(logits, cp.shard(labels), reduction="sum") / n_tokens_global
        >>> # loss.backward(); cp.all_reduce_gradients()      # = the single-process gradients
    """
    world, _ = world_and_rank(group)
    layout(scheme, 2 * world, world)  # validates the scheme name
    return ContextParallel(model, group, scheme, timeout, log, backend)
