"""Multi-head attention as a module: projections and layout around :func:`qkv.attention`.

Vaswani et al. 2017, "Attention Is All You Need" (multi-head attention); Shazeer 2019, "Fast Transformer
Decoding: One Write-Head is All You Need" (MQA); Ainslie et al. 2023, "GQA: Training Generalized
Multi-Query Transformer Models from Multi-Head Checkpoints"; QK normalization as in Dehghani et al.
2023, "Scaling Vision Transformers to 22 Billion Parameters" (per-head norm of queries and keys).

Shape legend: B batch, Nq queries, Nk keys (context or cache), d model width, Hq query heads, Hkv key/value
heads, D head dim.

Masking::

    no positions, no cache   causal -> masks.causal(); window W -> masks.sliding_window(W - 1)
    positions or a cache     masks.positions(q_positions, kv_positions, causal=, window=W)
    either way               & the ``mask`` passed to forward (e.g. masks.padding(lengths))

Example:
    >>> import torch, qkv
    >>> from qkv.nn import MultiHeadAttention
    >>> from qkv.pos import RotaryEmbedding
    >>> attn = MultiHeadAttention(64, 8, n_kv_heads=2, rope=RotaryEmbedding(8), causal=True)
    >>> x = torch.randn(2, 10, 64)
    >>> attn(x).out.shape
    torch.Size([2, 10, 64])
    >>> enc = torch.randn(2, 7, 64)
    >>> cross = MultiHeadAttention(64, 8, cross=True)
    >>> cross(x, enc, mask=qkv.masks.padding(torch.tensor([7, 4]))).out.shape
    torch.Size([2, 10, 64])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from .._attention import attention
from ..mods.base import as_score_mod
from ..pos.ids import batch_positions
from ..pos.relative import PositionalBias
from .cached import cached_attention
from .norm import make_norm

__all__ = ["MultiHeadAttention", "AttentionModuleOutput"]

_PROJ = ("q", "k", "v", "o")


class AttentionModuleOutput(NamedTuple):
    """``out`` (B, Nq, d); ``lse`` (B, Hq, Nq) float32 when ``need_lse=True``, else None."""

    out: torch.Tensor
    lse: torch.Tensor | None


def _biases(bias) -> dict[str, bool]:
    if isinstance(bias, bool):
        return dict.fromkeys(_PROJ, bias)
    if isinstance(bias, Mapping):
        unknown = set(bias) - set(_PROJ)
        if unknown:
            raise ValueError(f"MultiHeadAttention: bias keys must be among {_PROJ}, got {sorted(unknown)}")
        return {p: bool(bias.get(p, False)) for p in _PROJ}
    raise TypeError(f"MultiHeadAttention: bias must be a bool or a mapping like {{'q': True, 'k': True, 'v': True, "
                    f"'o': False}}, got {type(bias).__name__}")


class MultiHeadAttention(nn.Module):
    """Self or cross attention with MHA/GQA/MQA heads, optional biases, QK norm, positions and a KV cache.

    Args:
        d_model: model width ``d`` (input and output).
        n_heads: query heads ``Hq``.
        n_kv_heads: key/value heads ``Hkv`` (default ``Hq``; ``1`` is MQA; must divide ``Hq``).
        head_dim: per-head width ``D`` (default ``d_model // n_heads``).
        kv_dim: width of the cross-attention context (default ``d_model``).
        bias: biases on all projections (bool) or per projection, e.g. ``{"q": True, "k": True, "v": True,
            "o": False}`` (Qwen2); missing keys mean no bias.
        qk_norm: ``None``, ``"rms"`` or ``"layer"``: normalize each head's queries and keys before RoPE.
        qk_norm_eps: epsilon of the QK norm.
        rope: a :class:`qkv.pos.RotaryEmbedding` (or any ``rope(x, positions)`` callable) for self attention.
        position_bias: a :class:`qkv.pos.PositionalBias` module (ALiBi, T5 buckets, Shaw), called per forward.
        score_mod: static :mod:`qkv.mods` modifier(s), applied after the position bias (e.g. softcap).
        scale: score scale (default ``D ** -0.5``; T5 uses 1.0).
        dropout: attention-probability dropout while training (seeded by torch's default generator).
        backend: ``qkv.attention`` backend (``"auto"`` or a name from ``qkv.backends.names()``).
        causal: causal self attention.
        window: keys kept per query, the query included (HF ``sliding_window``); needs ``causal=True``.
        cross: cross attention over ``context`` (keys/values from the encoder, cached once with a cache).
        layer_idx: this layer's index in the KV cache.

    Attention runs through the instance attribute ``attention_fn`` (default :func:`qkv.attention`, same
    signature), which receives rotated queries and keys, the mask and score modifiers in absolute positions,
    and the scale; replacing it is how interpretation captures and context parallelism distributes attention.
    Around it, the cache update, RoPE, mask, head gate and observation are :func:`qkv.nn.cached_attention`'s.

    ``forward(x, context=None, *, mask=None, positions=None, cache=None, need_lse=False)``:
        x: (B, Nq, d). context: (B, Nk, kv_dim), cross attention only. mask: a :mod:`qkv.masks` mask
        AND-ed with the built one. positions: (Nq,) or (B, Nq) int64 absolute positions of ``x``'s tokens
        (``-1`` = padding, never attended); required with a cache. cache: a ``qkv.cache`` cache
        (:class:`qkv.cache.protocol.AttentionCache`). need_lse: also return the log-sum-exp.
        Returns :class:`AttentionModuleOutput` ``(out (B, Nq, d), lse (B, Hq, Nq) or None)``.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None, head_dim: int | None = None,
                 kv_dim: int | None = None, bias: bool | Mapping[str, bool] = True, qk_norm: str | None = None,
                 qk_norm_eps: float = 1e-6, rope: Callable | None = None, position_bias: PositionalBias | None = None,
                 score_mod=None, scale: float | None = None, dropout: float = 0.0, backend: str = "auto",
                 causal: bool = False, window: int | None = None, cross: bool = False, layer_idx: int = 0) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(f"MultiHeadAttention: n_heads ({n_heads}) must be a positive multiple of n_kv_heads "
                             f"({n_kv_heads})")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"MultiHeadAttention: d_model ({d_model}) is not divisible by n_heads ({n_heads}); "
                                 "pass head_dim explicitly")
            head_dim = d_model // n_heads
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"MultiHeadAttention: window must be a positive int (keys per query), got {window!r}")
        if window is not None and not causal:
            raise ValueError("MultiHeadAttention: window needs causal=True; for a bidirectional local window pass "
                             "mask=qkv.masks.sliding_window(left, right) to forward")
        if cross and (causal or window or rope is not None):
            raise ValueError("MultiHeadAttention: cross attention takes no causal mask, window or RoPE; pass a "
                             "mask to forward instead")
        if qk_norm not in (None, "rms", "layer"):
            raise ValueError(f"MultiHeadAttention: qk_norm must be None, 'rms' or 'layer', got {qk_norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout}")
        if position_bias is not None and not isinstance(position_bias, PositionalBias):
            raise TypeError(f"MultiHeadAttention: position_bias must be a qkv.pos.PositionalBias module, got "
                            f"{type(position_bias).__name__}; static modifiers go in score_mod")
        as_score_mod(score_mod)  # validates
        b = _biases(bias)
        kv_dim = d_model if kv_dim is None else kv_dim
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=b["q"])
        self.k_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=b["k"])
        self.v_proj = nn.Linear(kv_dim, n_kv_heads * head_dim, bias=b["v"])
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=b["o"])
        self.q_norm = make_norm(qk_norm, head_dim, eps=qk_norm_eps) if qk_norm else None
        self.k_norm = make_norm(qk_norm, head_dim, eps=qk_norm_eps) if qk_norm else None
        self.rope, self.position_bias, self.score_mod = rope, position_bias, score_mod
        self.scale, self.dropout, self.backend = scale, dropout, backend
        self.causal, self.window, self.cross, self.layer_idx = causal, window, cross, layer_idx
        self.attention_fn = attention  # the operator; replaceable (capture, context parallelism)
        self.head_gate: torch.Tensor | None = None  # (Hq,) multiplier of each head's output; None: 1

    def invalidate_fused_weights(self) -> None:
        """Forget weights derived from the projections (a fused QKV copy) after they were replaced; a no-op
        here, overridden by subclasses that keep such copies between calls."""

    def _heads(self, t: torch.Tensor, H: int) -> torch.Tensor:
        B, N, _ = t.shape
        return t.view(B, N, H, self.head_dim).transpose(1, 2)  # (B, H, N, D)

    def _project_kv(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._heads(self.k_proj(src), self.n_kv_heads)  # (B, Hkv, Nk, D)
        v = self._heads(self.v_proj(src), self.n_kv_heads)  # (B, Hkv, Nk, D)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask=None,
                positions: torch.Tensor | None = None, cache=None, need_lse: bool = False) -> AttentionModuleOutput:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"MultiHeadAttention: x must be (B, N, d_model={self.d_model}), got {tuple(x.shape)}")
        B, Nq, _ = x.shape
        q = self._heads(self.q_proj(x), self.n_heads)  # (B, Hq, Nq, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        kw = dict(mask=mask, score_mod=self.score_mod, position_bias=self.position_bias, scale=self.scale,
                  attention_fn=self.attention_fn, backend=self.backend, return_lse=need_lse,
                  dropout_p=self.dropout if self.training else 0.0, head_gate=self.head_gate,
                  layer_idx=self.layer_idx, owner="MultiHeadAttention")
        if self.cross:
            if context is None and cache is None:
                raise ValueError("MultiHeadAttention(cross=True): pass the encoder output as context")

            def compute():
                if context is None:
                    raise ValueError("MultiHeadAttention(cross=True): the cache holds no keys for layer "
                                     f"{self.layer_idx} yet; pass context on the first call")
                return self._project_kv(context)

            k, v = cache.cross_kv(self.layer_idx, compute) if cache is not None else compute()
            res = cached_attention(q, k, v, causal=False, **kw)  # the encoder's keys: no positions, no cache
        else:
            if context is not None:
                raise ValueError("MultiHeadAttention: context is for cross attention; build the module with "
                                 "cross=True")
            k, v = self._project_kv(x)  # (B, Hkv, Nq, D)
            if positions is not None:
                positions = batch_positions(positions, B, Nq, owner="MultiHeadAttention", device=x.device)
            res = cached_attention(q, k, v, cache=cache, positions=positions, rope=self.rope, causal=self.causal,
                                   window=self.window, **kw)
        out = res.out.transpose(1, 2).reshape(B, Nq, self.n_heads * self.head_dim)  # (B, Nq, Hq * D)
        return AttentionModuleOutput(self.o_proj(out), res.lse)

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"n_heads={self.n_heads}", f"n_kv_heads={self.n_kv_heads}",
                 f"head_dim={self.head_dim}"]
        for name in ("causal", "window", "cross"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.rope is not None:
            parts.append(f"rope={self.rope!r}")
        if self.score_mod is not None:
            parts.append(f"score_mod={self.score_mod!r}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)
