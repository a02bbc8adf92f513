"""Multi-head latent attention (MLA): DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model", Section 2.1 (arXiv:2405.04434).

Keys and values are compressed into one latent ``c_kv`` per token, shared by all heads; position
information rides on a separate ("decoupled") RoPE key ``k_rope``, also shared by all heads. The KV
cache holds only ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer::

    x ──kv_a_proj_with_mqa──> [c_kv | k_rope]     c_kv ──kv_a_layernorm──> cached; k_rope ──RoPE──> cached
    c_kv ──kv_b_proj──> per head [k_nope | v]      (W_UK: r -> dn, W_UV: r -> dv, per head)
    x ──q_proj (or q_a_proj -> q_a_layernorm -> q_b_proj)──> per head [q_nope | q_rope]
    score_h = scale * (q_nope_h . k_nope_h + RoPE(q_rope_h) . RoPE(k_rope))

Two exact ways to compute the same attention (``path``):

- ``expanded``: decompress every cached latent to per-head ``K = [k_nope | k_rope]`` and ``V`` through
  ``kv_b_proj``, then multi-head attention. Right for prefill.
- ``absorbed``: ``q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c``, so fold ``W_UK`` into the query and
  attend in the latent space as multi-query attention with one kv head, ``K' = [c_kv | k_rope]``
  (``Dqk = r + dr``) and ``V' = c_kv`` (``Dv = r``); ``W_UV`` is applied to the (per-head) output. The
  cache is never decompressed. Right for decode. The query heads share the single kv head, so they are
  stacked as extra query rows of one head (``(B, H, Nq, D) -> (B, 1, H*Nq, D)``, the layout FlashMLA
  uses) and the causal mask follows them by position.

Which is cheaper (forward FLOPs per sequence; ``r`` kv_lora_rank, ``dn``/``dr``/``dv`` head dims, ``H``
heads, ``P`` allowed (query, key) pairs; the q/kv_a/o projections are common to both and left out)::

    expanded = 2 H Nk r (dn + dv)              decompress the whole cache
             + 2 H P (dn + dr + dv)            attention
    absorbed = 2 H Nq r (dn + dv)              W_UK into the queries, W_UV onto the outputs
             + 2 H P (2 r + dr)                attention in the latent space

    expanded - absorbed = 2 H [ r (dn + dv) (Nk - Nq) - P (2 r - dn - dv) ]

With dense pairs ``P = Nq Nk`` absorbed is cheaper exactly when ``Nq Nk / (Nk - Nq) < N* = r (dn + dv) /
(2 r - dn - dv)``: the crossover is a number of queries (``N* ~ 171`` for DeepSeek-V2's r=512, dn=dv=128),
not a model-size effect, and ``H`` and the batch cancel. Decode (``Nq = 1``), speculative verification
and short chunks over a long cache go absorbed; prefill (``Nq = Nk``) goes expanded. ``path="auto"``
compares the two counts exactly (with the causal pair count); :meth:`LatentAttention.explain_path`
prints them.

Parameter and config names are HF transformers' ``DeepseekV2Attention`` ones, so a checkpoint's
attention weights load with ``load_state_dict`` unchanged. RoPE on ``q_rope``/``k_rope`` uses the
interleaved channel pairs ``(2f, 2f+1)``, as HF's DeepSeek-V2 does; with YaRN scaling and
``mscale_all_dim`` the softmax scale is multiplied by ``mscale(factor, mscale_all_dim) ** 2``. Kimi Linear's
MLA (Kimi Team 2025, arXiv:2510.26692) has no positions (``LatentConfig.use_rope=False``): the same
arithmetic with nothing rotated, ``q_rope . k_rope`` a plain dot product with the shared key part.

Shape legend: B batch, N tokens of ``x`` (= Nq), Nk keys (cached tokens), d ``hidden_size``, H heads,
r ``kv_lora_rank``, dn ``qk_nope_head_dim``, dr ``qk_rope_head_dim``, dv ``v_head_dim``.

Example:
    >>> import torch
    >>> from qkv.cache import KVCache
    >>> from qkv.nn.latent import LatentAttention, LatentConfig
    >>> cfg = LatentConfig(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
    ...                    qk_rope_head_dim=8, v_head_dim=16)
    >>> attn = LatentAttention(cfg)
    >>> x = torch.randn(2, 10, 64)
    >>> cache = KVCache([attn.cache_spec()])
    >>> prefill = attn(x[:, :9], positions=torch.arange(9), cache=cache)
    >>> step = attn(x[:, 9:], positions=torch.tensor([9]), cache=cache)
    >>> prefill.path, step.path, step.out.shape
    ('expanded', 'absorbed', torch.Size([2, 1, 64]))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._attention import attention
from ..config.latent import LatentConfig
from ..costs.flops import attention_flops, mla_absorbed_flops
from ..pos.rope import RotaryEmbedding
from .cached import AttentionHeads, attention_mask, cache_capabilities, plain_decode_step
from .norm import RMSNorm
from .protocol import apply_head_gate

if TYPE_CHECKING:
    from ..config.decoder import DecoderConfig
    from .mixer import MixerStep

__all__ = ["LatentConfig", "LatentAttention", "LatentAttentionOutput", "LatentHeads", "PathChoice",
           "PATHS", "mla_expanded", "mla_absorbed", "path_flops", "crossover_queries"]

PATHS = ("auto", "expanded", "absorbed")

RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PathChoice(NamedTuple):
    """Which path a forward takes and the FLOP counts behind it (forward, all ``batch`` sequences, the
    parts that differ between paths: projections common to both are left out)."""

    path: str
    expanded_flops: int
    absorbed_flops: int
    crossover: float  # N*: dense pairs, absorbed is cheaper iff Nq * Nk / (Nk - Nq) < N*
    reason: str

    def __str__(self) -> str:
        return (f"MLA path: {self.path} ({self.reason})\n"
                f"  expanded {self.expanded_flops / 1e9:10.4g} GFLOP  (decompress the cache + attention)\n"
                f"  absorbed {self.absorbed_flops / 1e9:10.4g} GFLOP  (absorb W_UK/W_UV + latent attention)")


def crossover_queries(config: LatentConfig) -> float:
    """``N* = r (dn + dv) / (2 r - dn - dv)`` (``inf`` when ``2 r <= dn + dv``): with dense pairs the
    absorbed path is cheaper exactly when ``Nq * Nk / (Nk - Nq) < N*`` (about ``Nq < N*`` for a long cache).

    Example:
        >>> round(crossover_queries(LatentConfig(hidden_size=8, num_attention_heads=1, kv_lora_rank=512)), 1)
        170.7
    """
    r, dn, dv = config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim
    extra = 2 * r - dn - dv
    return math.inf if extra <= 0 else r * (dn + dv) / extra


def path_flops(config: LatentConfig, nq: int, nk: int, *, batch: int = 1, causal: bool = True) -> tuple[int, int]:
    """``(expanded, absorbed)`` forward FLOPs of the parts that differ (module docstring), ``nq`` queries
    over ``nk`` keys, bottom-right causal pairs when ``causal``."""
    H, r = config.num_attention_heads, config.kv_lora_rank
    dn, dr, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    expanded = (2 * batch * nk * r * H * (dn + dv)
                + attention_flops(batch, H, nq, nk, dn + dr, v_head_dim=dv, causal=causal))
    absorbed = (2 * batch * nq * H * r * (dn + dv)
                + mla_absorbed_flops(batch, H, nq, nk, kv_lora_rank=r, qk_rope_head_dim=dr, causal=causal))
    return expanded, absorbed


def _choose(config: LatentConfig, nq: int, nk: int, *, causal: bool, path: str) -> PathChoice:
    if path not in PATHS:
        raise ValueError(f"LatentAttention: path must be one of {PATHS}, got {path!r}")
    expanded, absorbed = path_flops(config, nq, nk, causal=causal)
    n_star = crossover_queries(config)
    if path != "auto":
        return PathChoice(path, expanded, absorbed, n_star, f"forced by path={path!r}")
    chosen = "absorbed" if absorbed < expanded else "expanded"
    ratio = max(expanded, absorbed) / max(min(expanded, absorbed), 1)
    why = (f"Nq={nq}, Nk={nk}: {chosen} needs {ratio:.3g}x fewer FLOPs; crossover N*={n_star:.4g} queries "
           f"(absorbed iff Nq*Nk/(Nk-Nq) < N* with dense pairs)")
    return PathChoice(chosen, expanded, absorbed, n_star, why)


# the two paths
#: Per-head attention output of :func:`mla_expanded` / :func:`mla_absorbed`: ``out`` (B, H, Nq, dv) in the input
#: dtype; ``lse`` (B, H, Nq) float32 when ``return_lse``, else None (:class:`qkv.nn.cached.AttentionHeads`).
LatentHeads = AttentionHeads


def _check_inputs(fn: str, q_nope, q_rope, c_kv, k_rope, kv_b_weight) -> tuple[int, int]:
    for name, t, rank in (("q_nope", q_nope, 4), ("q_rope", q_rope, 4), ("c_kv", c_kv, 3), ("k_rope", k_rope, 3),
                          ("kv_b_weight", kv_b_weight, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{fn}: {name} must be a rank-{rank} tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    B, H, Nq, dn = q_nope.shape
    if q_rope.shape[:3] != (B, H, Nq) or k_rope.shape[-1] != q_rope.shape[-1]:
        raise ValueError(f"{fn}: q_rope must be (B, H, Nq, dr) = {(B, H, Nq)} + (dr,) with dr = k_rope's last dim, "
                         f"got q_rope {tuple(q_rope.shape)}, k_rope {tuple(k_rope.shape)}")
    if c_kv.shape[0] != B or k_rope.shape[:2] != c_kv.shape[:2]:
        raise ValueError(f"{fn}: c_kv (B, Nk, r) and k_rope (B, Nk, dr) must share (B={B}, Nk), got "
                         f"c_kv {tuple(c_kv.shape)}, k_rope {tuple(k_rope.shape)}")
    rows, r = kv_b_weight.shape
    if r != c_kv.shape[-1] or rows % H or rows // H <= dn:
        raise ValueError(f"{fn}: kv_b_weight must be (H * (dn + dv), r) = ({H} * ({dn} + dv), {c_kv.shape[-1]}) "
                         f"(kv_b_proj.weight), got {tuple(kv_b_weight.shape)}")
    return dn, rows // H - dn


def _as_2d(positions: torch.Tensor | None, B: int, N: int, name: str, device) -> torch.Tensor | None:
    if positions is None:
        return None
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"MLA: {name} must be an integer tensor (N,) or (B, N), got {positions!r}")
    p = positions.unsqueeze(0) if positions.dim() == 1 else positions
    if p.dim() != 2 or p.shape[1] != N or p.shape[0] not in (1, B):
        raise ValueError(f"MLA: {name} must have shape ({N},) or ({B}, {N}), got {tuple(positions.shape)}")
    return p.to(device=device, dtype=torch.int64).expand(B, N)


def _positions_pair(q_positions, kv_positions, B, Nq, Nk, device):
    if (q_positions is None) != (kv_positions is None):
        raise ValueError("MLA: pass both q_positions and kv_positions, or neither (bottom-right alignment)")
    return _as_2d(q_positions, B, Nq, "q_positions", device), _as_2d(kv_positions, B, Nk, "kv_positions", device)


def _gpu_decode(q_lat, q_rope, c_kv, k_rope, q_pos, kv_pos, scale):
    """One decode step through the Triton MLA kernel when the tensors are on CUDA, triton is present and
    nothing needs gradients: ``(o_lat (B, H, r), lse (B, H))``; otherwise None (the caller's path runs)."""
    from ..backends.triton import gpu_decode_ready

    if not gpu_decode_ready(q_lat, q_rope, c_kv, k_rope):
        return None
    from ..backends.triton.decode import mla_decode

    B, Nk = c_kv.shape[0], c_kv.shape[1]
    if q_pos is None:  # bottom-right: the query sits at the last key
        kv_pos = torch.arange(Nk, device=c_kv.device).expand(B, Nk)
        q_pos = torch.full((B, 1), Nk - 1, device=c_kv.device)
    return mla_decode(q_lat[:, :, 0], q_rope[:, :, 0], c_kv, k_rope, kv_pos, q_pos[:, 0], scale=scale)


def mla_expanded(q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                 kv_b_weight: torch.Tensor, *, q_positions: torch.Tensor | None = None,
                 kv_positions: torch.Tensor | None = None, causal: bool = True, mask=None,
                 scale: float | None = None, dropout_p: float = 0.0, return_lse: bool = False,
                 backend: str = "auto", attention_fn: Callable = attention) -> LatentHeads:
    """MLA by decompression: per-head ``K = [c_kv W_UK_h^T | k_rope]``, ``V = c_kv W_UV_h^T``, then
    multi-head attention. Costs ``2 H Nk r (dn + dv)`` FLOPs to decompress all ``Nk`` keys.

    Args:
        q_nope: (B, H, Nq, dn) query channels without position.
        q_rope: (B, H, Nq, dr) query RoPE channels, already rotated.
        c_kv: (B, Nk, r) normalized latents (what the cache holds).
        k_rope: (B, Nk, dr) the shared RoPE key, already rotated.
        kv_b_weight: (H * (dn + dv), r), ``kv_b_proj.weight``: per head ``dn`` rows of ``W_UK`` then ``dv``
            rows of ``W_UV``.
        q_positions, kv_positions: (Nq,)/(B, Nq) and (Nk,)/(B, Nk) int64 positions (``-1`` = padding);
            the mask is ``masks.positions(q_positions, kv_positions, causal=causal)``. Without them,
            ``masks.causal()`` (bottom-right) when ``causal``.
        causal: causal mask.
        mask: an extra :mod:`qkv.masks` mask in (B, H, Nq, Nk) coordinates, AND-ed with the built one.
        scale: softmax scale (default ``(dn + dr) ** -0.5``).
        dropout_p, return_lse, backend: as in :func:`qkv.attention`.
        attention_fn: the attention operator, with :func:`qkv.attention`'s signature (default it).

    Returns:
        :class:`LatentHeads` ``(out (B, H, Nq, dv), lse (B, H, Nq) or None)``.
    """
    dn, dv = _check_inputs("mla_expanded", q_nope, q_rope, c_kv, k_rope, kv_b_weight)
    B, H, Nq, _ = q_nope.shape
    Nk, dr = k_rope.shape[1], k_rope.shape[2]
    q_pos, kv_pos = _positions_pair(q_positions, kv_positions, B, Nq, Nk, q_nope.device)
    kv_BHSe = F.linear(c_kv, kv_b_weight).view(B, Nk, H, dn + dv).transpose(1, 2)  # (B, H, Nk, dn + dv)
    k_nope_BHSn, v_BHSv = kv_BHSe.split([dn, dv], dim=-1)
    k_BHSk = torch.cat((k_nope_BHSn, k_rope.unsqueeze(1).expand(B, H, Nk, dr)), dim=-1)  # (B, H, Nk, dn + dr)
    q_BHNk = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, Nq, dn + dr)
    res = attention_fn(q_BHNk, k_BHSk, v_BHSv, mask=attention_mask(q_pos, kv_pos, causal=causal, mask=mask),
                    scale=(dn + dr) ** -0.5 if scale is None else scale, return_lse=return_lse,
                    dropout_p=dropout_p, backend=backend)
    return LatentHeads(res.out, res.lse) if return_lse else LatentHeads(res, None)


def mla_absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                 kv_b_weight: torch.Tensor, *, q_positions: torch.Tensor | None = None,
                 kv_positions: torch.Tensor | None = None, causal: bool = True, mask=None,
                 scale: float | None = None, dropout_p: float = 0.0, return_lse: bool = False,
                 backend: str = "auto", attention_fn: Callable = attention) -> LatentHeads:
    """MLA in the latent space: ``q_lat_h = W_UK_h^T q_nope_h``, multi-query attention of
    ``[q_lat | q_rope]`` over ``K' = [c_kv | k_rope]``, ``V' = c_kv``, then ``out_h = W_UV_h o_lat_h``.
    The latents are never decompressed. Same arguments and result as :func:`mla_expanded`.

    The H query heads read one kv head, so (without an extra ``mask``) they are stacked as ``H * Nq`` query rows
    of a single head and the mask is rebuilt by position (``q_positions`` tiled H times; without positions,
    bottom-right: query ``i`` at ``i + Nk - Nq``); a one-query step with positions is passed as grouped-query
    attention over the one KV head (the backend folds the heads into rows itself). An extra ``mask``, whose
    coordinates are (b, h, q_idx, kv_idx), keeps the (B, H, Nq) layout with ``Hkv = 1`` instead. With dropout
    the keep-pattern differs from :func:`mla_expanded`'s (same distribution).
    """
    dn, dv = _check_inputs("mla_absorbed", q_nope, q_rope, c_kv, k_rope, kv_b_weight)
    B, H, Nq, _ = q_nope.shape
    Nk, r = c_kv.shape[1], c_kv.shape[2]
    dr = k_rope.shape[2]
    q_pos, kv_pos = _positions_pair(q_positions, kv_positions, B, Nq, Nk, q_nope.device)
    w_HEr = kv_b_weight.view(H, dn + dv, r)
    w_uk_Hnr, w_uv_Hvr = w_HEr[:, :dn], w_HEr[:, dn:]
    # Per-head GEMMs over all B * Nq rows at once: one accumulation (one rounding) per weight gradient,
    # where a broadcast over B would sum per-batch gradients in the input dtype.
    q_HMn = q_nope.transpose(0, 1).reshape(H, B * Nq, dn)
    q_lat_BHNr = torch.bmm(q_HMn, w_uk_Hnr).view(H, B, Nq, r).transpose(0, 1)  # (B, H, Nq, r): W_UK in the query
    q_BHNc = torch.cat((q_lat_BHNr, q_rope), dim=-1)  # (B, H, Nq, r + dr)
    kv_B1Sc = torch.cat((c_kv, k_rope), dim=-1).unsqueeze(1)  # (B, 1, Nk, r + dr): the only "key"
    # The value is the latent, the key's first r channels. Attending with V = K and keeping the first r
    # output channels is the same arithmetic, and gives SDPA's fused CPU kernel the equal q/k/v widths it
    # needs (its math fallback is 2.5x slower for a decode step); the dr extra channels are dropped.
    scale = (dn + dr) ** -0.5 if scale is None else scale
    kw = dict(scale=scale, return_lse=return_lse, dropout_p=dropout_p, backend=backend)
    fast = None
    if plain_decode_step(Nq, attention_fn=attention_fn, backend=backend, causal=causal or q_pos is None, mask=mask,
                         dropout_p=dropout_p):  # a decode step on a GPU: the Triton latent kernel
        fast = _gpu_decode(q_lat_BHNr, q_rope, c_kv, k_rope, q_pos, kv_pos, scale)
    if fast is not None:
        o_lat_BHNr, lse = fast[0].unsqueeze(2), (fast[1].unsqueeze(2) if return_lse else None)
    elif mask is None and Nq == 1 and q_pos is not None:  # a decode step: grouped-query attention, one KV head
        res = attention_fn(q_BHNc, kv_B1Sc, kv_B1Sc, mask=attention_mask(q_pos, kv_pos, causal=causal), **kw)
        o_lat_BHNr, lse = (res.out[..., :r], res.lse) if return_lse else (res[..., :r], None)
    elif mask is None:
        if q_pos is None and causal:
            q_pos = (torch.arange(Nq, device=q_nope.device) + (Nk - Nq)).expand(B, Nq)
            kv_pos = torch.arange(Nk, device=q_nope.device).expand(B, Nk)
        folded = None
        if q_pos is not None:  # each head's rows at their query positions (a view for one query: no copy)
            folded = attention_mask(q_pos.expand(B, H) if Nq == 1 else q_pos.repeat(1, H), kv_pos, causal=causal)
        res = attention_fn(q_BHNc.reshape(B, 1, H * Nq, r + dr), kv_B1Sc, kv_B1Sc, mask=folded, **kw)
        out_B1Mc, lse = (res.out, res.lse.view(B, H, Nq)) if return_lse else (res, None)
        o_lat_BHNr = out_B1Mc[..., :r].view(B, H, Nq, r)
    else:
        res = attention_fn(q_BHNc, kv_B1Sc, kv_B1Sc, mask=attention_mask(q_pos, kv_pos, causal=causal, mask=mask),
                           **kw)
        o_lat_BHNr, lse = (res.out[..., :r], res.lse) if return_lse else (res[..., :r], None)
    o_HMr = o_lat_BHNr.transpose(0, 1).reshape(H, B * Nq, r)
    out_BHNv = torch.bmm(o_HMr, w_uv_Hvr.transpose(1, 2)).view(H, B, Nq, dv).transpose(0, 1)  # W_UV after attention
    return LatentHeads(out_BHNv, lse)


class LatentAttentionOutput(NamedTuple):
    """``out`` (B, N, d); ``lse`` (B, H, N) float32 when ``need_lse=True`` else None; ``path`` taken."""

    out: torch.Tensor
    lse: torch.Tensor | None
    path: str


class LatentAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention (causal self attention) with a latent-only KV cache.

    Args:
        config: a :class:`LatentConfig` (``LatentConfig.from_hf(hf_config)`` for a checkpoint).
        rope: a ``rope(x, positions)`` callable for the ``dr`` RoPE channels; default a
            :class:`qkv.pos.RotaryEmbedding` from the config with interleaved pairs (HF DeepSeek-V2). Must be
            None when ``config.use_rope`` is False (NoPE: nothing is rotated).
        path: ``"auto"`` (fewer FLOPs, see :meth:`explain_path`), ``"expanded"`` or ``"absorbed"``.
        causal: causal mask (DeepSeek-V2 is causal; ``False`` attends to every key).
        backend: the ``qkv.attention`` backend.
        layer_idx: this layer's index in the KV cache.
        device, dtype: of the parameters.

    ``forward(x, *, positions=None, cache=None, mask=None, path=None, need_lse=False)``:
        x: (B, N, d). positions: (N,) or (B, N) int64 absolute positions (``-1`` = padding, never
        attended); required with a cache; default ``0 .. N-1``. cache: an object with
        ``update_latent(layer_idx, c_kv, k_rope, positions=, rope=) -> LatentView`` (e.g.
        ``qkv.cache.KVCache([attn.cache_spec()])``); only ``c_kv`` (B, N, r) and ``k_rope`` (B, N, dr)
        are handed to it. mask: an extra :mod:`qkv.masks` mask, AND-ed. path: overrides the module's.
        Returns :class:`LatentAttentionOutput` ``(out (B, N, d), lse or None, path)``.

    As an attention module (:class:`qkv.nn.protocol.AttentionModule`): both paths call ``attention_fn``;
    ``n_heads`` is ``H`` and ``n_kv_heads`` is 1 (one latent shared by every head; the absorbed path stacks the
    heads as ``H * N`` query rows of one head); ``head_gate`` scales each head's output (after ``W_UV``) before
    ``o_proj``. The masks, the decode-kernel rule and the head gate are those of
    :mod:`qkv.nn.cached`. A cache that also follows :class:`qkv.cache.AttentionCache` and ranks a latent layer's
    tokens by observed attention (``scores_attention``) is shown the absorbed queries ``[W_UK^T q_nope |
    RoPE(q_rope)]`` (B, H, N, r + dr), whose dot products with the cached ``[c_kv | k_rope]`` are the layer's
    scores (``observe``); caches that do not score latents (KVCache) are shown nothing.
    """

    def __init__(self, config: LatentConfig, *, rope: RopeFn | None = None, path: str = "auto", causal: bool = True,
                 backend: str = "auto", layer_idx: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, LatentConfig):
            raise TypeError(f"LatentAttention: config must be a LatentConfig (LatentConfig.from_hf(hf_config) for "
                            f"an HF config), got {type(config).__name__}")
        if path not in PATHS:
            raise ValueError(f"LatentAttention: path must be one of {PATHS}, got {path!r}")
        kw = {"device": device, "dtype": dtype}
        c = config
        H, d, r = c.num_attention_heads, c.hidden_size, c.kv_lora_rank
        self.config, self.path, self.causal, self.backend, self.layer_idx = c, path, causal, backend, layer_idx
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * c.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=c.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(d, r + c.qk_rope_head_dim, bias=c.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(r, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(r, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(H * c.v_head_dim, d, bias=c.attention_bias, **kw)
        if device is not None or dtype is not None:
            self.kv_a_layernorm.to(**kw)
            if c.q_lora_rank is not None:
                self.q_a_layernorm.to(**kw)
        self.attention_fn = attention  # the operator both paths call; replaceable (capture, context parallelism)
        if not c.use_rope and rope is not None:
            raise ValueError("LatentAttention: config.use_rope is False (NoPE), so nothing is rotated; pass rope=None "
                             "or a LatentConfig with use_rope=True")
        self.rope: RopeFn | None = None if not c.use_rope else rope if rope is not None else RotaryEmbedding(
            c.qk_rope_head_dim, theta=c.rope_theta, scaling=c.rope_scaling,
            max_position_embeddings=c.max_position_embeddings, interleaved=True)
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1

    @property
    def n_heads(self) -> int:
        """Query heads ``H`` (:class:`qkv.nn.protocol.AttentionModule`)."""
        return self.config.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        """1: every head reads the one cached latent (:class:`qkv.nn.protocol.AttentionModule`)."""
        return 1

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope: RopeFn | None = None) -> LatentAttention:
        """The MLA mixer of layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`): every step on the config's
        ``decode_backend`` when its backend is ``"auto"`` (one backend per layer), else on its backend."""
        c = config
        backend = (c.decode_backend if c.backend == "auto" and c.decode_backend and not c.latent.attention_dropout
                   else c.backend)
        return cls(c.latent, rope=rope, backend=backend, layer_idx=layer_idx)

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """The decoder's call (:class:`qkv.nn.mixer.DecoderMixer`): every column attends (the decoder keeps the
        last ``keep``)."""
        return self(x, positions=step.positions, cache=step.cache).out

    def score_modifiers(self) -> tuple:
        return ()

    def cache_spec(self):
        """This layer's :class:`qkv.cache.LatentSpec`: ``kv_lora_rank + qk_rope_head_dim`` per token."""
        from ..cache.specs import LatentSpec

        return LatentSpec(self.config.kv_lora_rank, self.config.qk_rope_head_dim)

    def explain_path(self, nq: int, nk: int, *, path: str | None = None) -> PathChoice:
        """Which path a forward of ``nq`` queries over ``nk`` keys (cached ones included) takes, and why.

        Example:
            >>> cfg = LatentConfig(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512)
            >>> LatentAttention(cfg, device="meta").explain_path(1, 4096).path
            'absorbed'
        """
        return _choose(self.config, nq, nk, causal=self.causal, path=self.path if path is None else path)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None, cache=None, mask=None,
                path: str | None = None, need_lse: bool = False) -> LatentAttentionOutput:
        c = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"LatentAttention: x must be (B, N, hidden_size={c.hidden_size}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        B, N, _ = x.shape
        H, r, dn, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
        q_BHNk = self._query(x).view(B, N, H, dn + dr).transpose(1, 2)  # (B, H, N, dn + dr)
        q_nope_BHNn, q_rope_BHNr = q_BHNk.split([dn, dr], dim=-1)
        c_kv_BNr, k_rope_BNr = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
        c_kv_BNr = self.kv_a_layernorm(c_kv_BNr)  # (B, N, r): normalized before caching, as HF does
        pos = _as_2d(positions, B, N, "positions", x.device)
        caps = None
        if cache is not None:
            caps = cache_capabilities(cache)
            if not caps.latent:
                raise TypeError(f"LatentAttention: the cache must follow qkv.cache.LatentCache (update_latent: MLA "
                                f"caches latents, not K/V); build it from this layer's spec, e.g. "
                                f"KVCache([attn.cache_spec()]), got "
                                f"{type(cache).__name__}")
            if pos is None:
                raise ValueError("LatentAttention: a cache needs positions (B, N) of the new tokens")
            view = cache.update_latent(self.layer_idx, c_kv_BNr, k_rope_BNr, positions=pos, rope=self.rope)
            c_kv_BSr, k_rope_BSr, kv_pos, q_pos = view.c_kv, view.k_rope, view.kv_positions, view.q_positions
            if self.rope is not None:
                q_rope_BHNr = self.rope(q_rope_BHNr, q_pos.clamp_min(0))
        else:
            k_rope_BSr, c_kv_BSr, q_pos, kv_pos = k_rope_BNr, c_kv_BNr, pos, pos  # (B, N, dr), (B, N, r)
            if self.rope is not None:
                rot_pos = torch.arange(N, device=x.device) if pos is None else pos.clamp_min(0)
                q_rope_BHNr = self.rope(q_rope_BHNr, rot_pos)
                k_rope_BSr = self.rope(k_rope_BNr.unsqueeze(1), rot_pos).squeeze(1)
        scale_BN = c.query_scale(torch.arange(N, device=x.device) if q_pos is None else q_pos)  # (B, N) or (N,)
        if scale_BN is not None:  # Llama 4's attention temperature (Mistral 4); 1 below the period
            scale_B1N1 = scale_BN.to(q_nope_BHNn.dtype).view(-1, 1, N, 1)
            q_nope_BHNn, q_rope_BHNr = q_nope_BHNn * scale_B1N1, q_rope_BHNr * scale_B1N1
        choice = self.explain_path(N, c_kv_BSr.shape[1], path=path)
        fn = mla_absorbed if choice.path == "absorbed" else mla_expanded
        heads = fn(q_nope_BHNn, q_rope_BHNr, c_kv_BSr, k_rope_BSr, self.kv_b_proj.weight, q_positions=q_pos,
                   kv_positions=kv_pos, causal=self.causal, mask=mask, scale=c.softmax_scale,
                   dropout_p=c.attention_dropout if self.training else 0.0, return_lse=need_lse,
                   backend=self.backend, attention_fn=self.attention_fn)
        out_BHNv = apply_head_gate(heads.out, self.head_gate)
        if caps is not None and caps.attention and cache.scores_attention(self.layer_idx):
            cache.observe(self.layer_idx, self._latent_queries(q_nope_BHNn, q_rope_BHNr), scale=c.softmax_scale)
        out_BNv = out_BHNv.transpose(1, 2).reshape(B, N, H * c.v_head_dim)
        return LatentAttentionOutput(self.o_proj(out_BNv), heads.lse, choice.path)

    def _latent_queries(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """``[W_UK_h^T q_nope_h | q_rope_h]`` (B, H, N, r + dr): the queries whose dot products with the cached
        ``[c_kv | k_rope]`` are the scores (``q_rope`` already rotated)."""
        c = self.config
        H, dn, r = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        w_uk_Hnr = self.kv_b_proj.weight.view(H, dn + c.v_head_dim, r)[:, :dn]
        q_lat_BHNr = torch.einsum("bhnd,hdr->bhnr", q_nope, w_uk_Hnr.to(q_nope.dtype))
        return torch.cat((q_lat_BHNr, q_rope), dim=-1)

    def extra_repr(self) -> str:
        c = self.config
        parts = [f"hidden_size={c.hidden_size}", f"heads={c.num_attention_heads}", f"kv_lora_rank={c.kv_lora_rank}",
                 f"q_lora_rank={c.q_lora_rank}", f"qk_nope={c.qk_nope_head_dim}", f"qk_rope={c.qk_rope_head_dim}",
                 f"v={c.v_head_dim}", f"path={self.path!r}"]
        if not c.use_rope:
            parts.append("nope")
        if not self.causal:
            parts.append("causal=False")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)
