"""``PerformerAttention``: multi-head self-attention by FAVOR+ random features, with a redraw schedule.

Choromanski et al., "Rethinking Attention with Performers", ICLR 2021 (arXiv:2009.14794). Section 4
of the paper redraws the random features during training; this module makes that schedule explicit.

Everything that decides the module's output is a buffer, so ``state_dict`` captures it and a loaded
model reproduces outputs and future redraws:

* ``projection`` ``(m, Dh)``: the current random features (shared by all heads).
* ``rng_state``: the module's own generator state; redraws come only from it.
* ``training_steps``: forward calls made in training mode; a redraw happens before the call whose
  count is a positive multiple of ``redraw_every``.
* ``frozen``: set by ``freeze_features()``; no scheduled redraw happens once it is set.

Shape legend: B batch, N tokens, E model dim (``d_model``), H heads, Dh head dim (``E // H``),
m random features.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.linear._common import LinearAttentionOutput, LinearState
from qkv.linear.chunk import DEFAULT_CHUNK_SIZE
from qkv.linear.performer import (
    PERFORMER_EPS,
    default_num_features,
    orthogonal_gaussian,
    performer_attention,
    performer_attention_step,
)
from qkv.nn._heads import add_projections, check_dims, check_x, merge_heads, split_heads

__all__ = ["PerformerAttention"]


class PerformerAttention(nn.Module):
    """Multi-head self-attention estimating softmax with ``m`` positive orthogonal random features.

    Args:
        d_model: E, model width; must be divisible by ``n_heads``.
        n_heads: H.
        num_features: m; default ``round(Dh ln Dh)``.
        causal: token ``i`` attends to tokens ``<= i`` (needed for ``step``); no output depends on a
            later token.
        redraw_every: draw fresh features every this many training-mode forward calls (each
            micro-batch counts); ``None`` never redraws. Eval mode never redraws.
        seed: seed of the module's generator; ``None`` takes one from torch's global RNG (so
            ``torch.manual_seed`` before construction makes the module reproducible and two layers
            get different features).
        chunk_size: tokens per chunk in the causal prefill.
        eps: absolute guard on the normalizer.
        bias: bias in the four projections.
        layer_idx: this layer's index among the model's layers.
        device, dtype: for the parameters and the ``projection`` buffer.

    Example:
        >>> import torch
        >>> attn = PerformerAttention(32, 4, causal=True, redraw_every=100, seed=0)
        >>> x = torch.randn(2, 10, 32)
        >>> out, state = attn(x)
        >>> out.shape, state.S.shape      # state: (B, H, m, Dh)
        (torch.Size([2, 10, 32]), torch.Size([2, 4, 17, 8]))
        >>> attn2 = PerformerAttention(32, 4, causal=True, redraw_every=100, seed=1)
        >>> _ = attn2.load_state_dict(attn.state_dict())
        >>> torch.equal(attn2(x).out, out)
        True
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        num_features: int | None = None,
        causal: bool = False,
        redraw_every: int | None = None,
        seed: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        eps: float = PERFORMER_EPS,
        bias: bool = True,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_dims("PerformerAttention", d_model, n_heads)
        head_dim = d_model // n_heads
        m = default_num_features(head_dim) if num_features is None else num_features
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"PerformerAttention: num_features must be a positive int or None, got {num_features!r}")
        if redraw_every is not None and (not isinstance(redraw_every, int) or isinstance(redraw_every, bool)
                                         or redraw_every < 1):
            raise ValueError(f"PerformerAttention: redraw_every must be a positive int or None, got {redraw_every!r}")
        self.d_model, self.n_heads, self.num_features = d_model, n_heads, m
        self.causal, self.redraw_every, self.chunk_size, self.eps = causal, redraw_every, chunk_size, eps
        add_projections(self, d_model, bias=bias, device=device, dtype=dtype)
        self.layer_idx = layer_idx
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1

        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        g = torch.Generator().manual_seed(seed)
        W = orthogonal_gaussian(m, head_dim, generator=g, dtype=dtype or torch.get_default_dtype(), device=device)
        self.register_buffer("projection", W)  # (m, Dh)
        self.register_buffer("rng_state", g.get_state())  # uint8, CPU generator state after this draw
        self.register_buffer("training_steps", torch.zeros((), dtype=torch.long, device=device))
        self.register_buffer("frozen", torch.zeros((), dtype=torch.bool, device=device))

    @property
    def attention_fn(self) -> None:
        """None: there is no softmax operator call to hook (a feature map replaces softmax attention), so tools
        that replace the operator (capture, packed documents, context parallelism) refuse this module
        (:class:`qkv.nn.protocol.AttentionModule`)."""
        return None

    @property
    def n_kv_heads(self) -> int:
        """``n_heads``: every head has its own keys and values."""
        return self.n_heads

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw a new ``projection`` from the module's generator (whether frozen or not)."""
        g = torch.Generator()
        g.set_state(self.rng_state.cpu())
        W = orthogonal_gaussian(self.num_features, self.d_model // self.n_heads, generator=g)
        self.projection.copy_(W)
        self.rng_state.copy_(g.get_state())

    @torch.no_grad()
    def freeze_features(self) -> None:
        """Stop scheduled redraws: the current ``projection`` is used from now on (saved with the model)."""
        self.frozen.fill_(True)

    def _advance_schedule(self) -> None:
        if not self.training:
            return
        with torch.no_grad():
            n = int(self.training_steps)
            if self.redraw_every is not None and not bool(self.frozen) and n > 0 and n % self.redraw_every == 0:
                self.redraw_features()
            self.training_steps.add_(1)

    def forward(self, x: torch.Tensor, *, state: LinearState | None = None) -> LinearAttentionOutput:
        """Attend over a whole sequence (advancing the redraw schedule in training mode).

        Args:
            x: ``(B, N, E)``.
            state: ``LinearState(S (B, H, m, Dh), z (B, H, m))`` left by earlier tokens (causal), or ``None``.

        Returns:
            ``LinearAttentionOutput(out (B, N, E) in x's dtype, state after the last token)``.
        """
        check_x(x, self.d_model, fn="PerformerAttention.forward")
        self._advance_schedule()
        q, k, v = split_heads(self, x, self.n_heads)
        out, new_state = performer_attention(q, k, v, self.projection, causal=self.causal, eps=self.eps,
                                             chunk_size=self.chunk_size, initial_state=state)
        return LinearAttentionOutput(merge_heads(self, out), new_state)

    def step(self, x: torch.Tensor, state: LinearState | None) -> LinearAttentionOutput:
        """Decode one token in O(m Dh) per head; never redraws (a redraw would invalidate ``state``).

        Args:
            x: ``(B, 1, E)``.
            state: from a causal ``forward`` or an earlier ``step``; ``None`` for the first token.

        Returns:
            ``LinearAttentionOutput(out (B, 1, E), state including this token)``.
        """
        if not self.causal:
            raise ValueError("PerformerAttention.step decodes causally; build the module with causal=True")
        check_x(x, self.d_model, fn="PerformerAttention.step", one_token=True)
        q, k, v = split_heads(self, x, self.n_heads)
        out, new_state = performer_attention_step(q, k, v, self.projection, state, eps=self.eps)
        return LinearAttentionOutput(merge_heads(self, out), new_state)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, num_features={self.num_features}, "
                f"causal={self.causal}, redraw_every={self.redraw_every}")
