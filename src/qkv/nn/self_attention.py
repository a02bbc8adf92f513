"""Causal grouped-query self attention, the softmax mixer of :class:`qkv.nn.DecoderLM`'s attention layers:
grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245) with one fused QKV projection, RoPE (Su et al.
2021, arXiv:2104.09864) per layer type, ALiBi (Press et al. 2022, arXiv:2108.12409) or no positions, optional QKV
bias, QK RMSNorm per head (Gemma 3) or over the projections (OLMo 2/3), a score scale, tanh score soft-capping
(Gemma 2), attention sinks (GPT-OSS), an output gate (Qwen3-Next) and a sliding window on local layers; and Gemma 4's
options (Gemma Team 2026, Gemma 4 model card): head width and KV heads per layer type, K = V (the key projection serves
as values: no value projection), an unscaled RMSNorm of values, and cross-layer KV sharing (Brandon et al. 2024,
arXiv:2405.12981): a layer with only a query projection that attends over an earlier layer's keys and values.

Shape legend: B batch, N new tokens, d hidden size, Hq query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import mods
from .._attention import attention
from ..config.decoder import DecoderConfig
from ..pos.alibi import ALiBiBias
from ..pos.rope import RotaryKernel, apply_rotary
from .cached import cached_attention
from .norm import RMSNorm, rms_norm

if TYPE_CHECKING:
    from .decoder import RopeTable
    from .mixer import MixerStep

__all__ = ["SelfAttention"]


class SelfAttention(nn.Module):
    """Causal grouped-query self attention of :class:`DecoderLM`: one fused QKV projection, positions by RoPE
    (a table of the model's), ALiBi or none (learned positions are added to the embeddings), the cache protocol.

    ``qkv_proj`` (d -> (Hq + 2 Hkv) D) stacks HF's ``q_proj``, ``k_proj``, ``v_proj`` rows in that order, so
    queries and keys are adjacent heads of one tensor and rotate in one call. Attention runs through
    ``self.attention_fn`` (signature of :func:`qkv.attention`; default it), which receives rotated queries
    and keys, the mask and the score modifiers in absolute positions, and the scale. ``scale`` may be set
    per layer after construction (GPT-2's ``scale_attn_by_inverse_layer_idx``). The cache update, rotation,
    mask, head gate and observation around it are :func:`qkv.nn.cached_attention`'s, given this layer's fused
    rotation and the step's shared mask.

    With K = V (``config.k_eq_v_for(layer_idx)``) ``qkv_proj`` gives queries and keys only, and the values are the
    keys before their norm and rotation. A layer that shares another's keys and values
    (``config.kv_source(layer_idx)``) has queries only: without a cache it reads the source's keys and values of
    the step (``step.shared_kv``, which the source fills), with one the source's cache view.
    """

    def __init__(self, c: DecoderConfig, layer_idx: int, rope: RopeTable | None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_attention_heads, c.kv_heads_for(layer_idx), \
            c.head_dim_for(layer_idx)
        self.layer_idx, self.window, self.rope = layer_idx, c.window_for(layer_idx), rope
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        self.kv_source = c.kv_source(layer_idx)  # cross-layer KV sharing: the layer whose keys and values it reads
        self.k_eq_v = c.k_eq_v_for(layer_idx)
        self.shares_kv = c.kv_shared_from is not None and layer_idx in c.kv_shared_from  # later layers read its kv
        self.kv_sets = 0 if self.kv_source is not None else 1 if self.k_eq_v else 2  # K, V projections it has
        self.value_norm_eps = c.rms_norm_eps if c.value_norm and self.kv_source is None else None
        self.output_gate = c.attn_output_gate  # then qkv_proj also gives the gate's Hq * D channels, last
        self.qkv_proj = nn.Linear(c.hidden_size, (Hq * c.attn_output_gate + Hq + self.kv_sets * Hkv) * D,
                                  bias=c.qkv_bias)
        self.o_proj = nn.Linear(Hq * D, c.hidden_size, bias=c.o_bias)
        self.qk_norm_projection = c.qk_norm and c.qk_norm_scope == "projection"  # OLMo 2/3: over all heads
        if self.qk_norm_projection and (self.kv_sets < 2 or self.value_norm_eps is not None):
            raise ValueError("DecoderLM: qk_norm_scope='projection' (OLMo 2/3) with K = V, value_norm or KV sharing "
                             "is not supported; use qk_norm_scope='head'")
        q_dim, k_dim = (Hq * D, Hkv * D) if self.qk_norm_projection else (D, D)
        self.q_norm = RMSNorm(q_dim, eps=c.rms_norm_eps, offset=c.norm_offset) if c.qk_norm else None
        self.k_norm = (RMSNorm(k_dim, eps=c.rms_norm_eps, offset=c.norm_offset)
                       if c.qk_norm and self.kv_source is None else None)
        self.sinks = nn.Parameter(torch.zeros(Hq)) if c.attention_sinks else None  # (Hq,) GPT-OSS sink logits
        self.alibi = ALiBiBias(Hq) if c.position == "alibi" else None
        self.scale = c.attention_scale
        self.score_mod = mods.softcap(c.attn_logit_softcapping) if c.attn_logit_softcapping else None
        self.backend = c.backend
        plain = self.score_mod is None and self.alibi is None
        self.decode_backend = c.decode_backend if c.backend == "auto" and c.decode_backend and plain else c.backend
        self.attention_fn = attention
        self.rotary_kernel: RotaryKernel | None = None  # qkv.cpu.optimize puts its compiled rotation here
        self.head_gate: torch.Tensor | None = None  # (Hq,) multiplier of each head's output; None: 1

    def _rotate_qk(self, q: torch.Tensor, k: torch.Tensor, qk: torch.Tensor | None, cos, sin):
        """Rotate queries and keys; in one call when they are still adjacent heads of ``qk``."""
        interleaved, fast = self.rope.emb.interleaved, self.rotary_kernel
        if qk is not None:
            both = apply_rotary(qk, cos, sin, interleaved=interleaved, kernel=fast)
            return both.split((self.n_heads, self.n_kv_heads), dim=1)
        return (apply_rotary(q, cos, sin, interleaved=interleaved, kernel=fast),
                apply_rotary(k, cos, sin, interleaved=interleaved, kernel=fast))

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope: RopeTable | None = None) -> SelfAttention:
        """The attention mixer of layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`)."""
        return cls(config, layer_idx, rope)

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """The decoder's call (:class:`qkv.nn.mixer.DecoderMixer`): :meth:`forward`."""
        return self(x, step, keep)

    def score_modifiers(self) -> tuple:
        """The softcap and ALiBi this layer adds to its scores, those it has."""
        return tuple(m for m in (self.score_mod, "ALiBi" if self.alibi is not None else None) if m is not None)

    def forward(self, x: torch.Tensor, step: MixerStep, keep: int = 0, mask=None) -> torch.Tensor:
        """(B, N, d) -> (B, N, d); with ``0 < keep < N`` the outputs of the last ``keep`` columns only, (B, keep, d)
        (every column's keys and values are still cached). ``mask``: a :mod:`qkv.masks` mask AND-ed with the
        causal one (a subclass's key selection, :class:`qkv.nn.IndexedAttention`)."""
        B, N, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (B, N, (Hq + 2 Hkv) D), then the output gate's (B, N, Hq D)
        gate = None
        if self.output_gate:
            qkv, gate = qkv.split(((Hq + self.kv_sets * Hkv) * D, Hq * D), dim=-1)
        if self.kv_sets < 2 or self.value_norm_eps is not None:
            return self._forward_unfused(x, qkv, gate, step, keep, mask)
        if self.qk_norm_projection:
            q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = qkv.view(B, N, Hq + 2 * Hkv, D).transpose(1, 2)  # (B, Hq + 2 Hkv, N, D)
        qk, v = qkv.split((Hq + Hkv, Hkv), dim=1)  # (B, Hq + Hkv, N, D), (B, Hkv, N, D)
        q, k = qk.split((Hq, Hkv), dim=1)
        if self.q_norm is not None and not self.qk_norm_projection:
            q, k, qk = self.q_norm(q), self.k_norm(k), None
        rope, rotate = self.rope, None
        if rope is not None:
            cos, sin = step.cos_sin(rope, x.device)  # (B, N, R) or (N, R)

            def rotate(q, k):
                return self._rotate_qk(q, k, qk, cos, sin)
        if self.shares_kv and step.cache is None:  # later layers read these keys (normed, not rotated) and values
            step.shared_kv[self.layer_idx] = (k, v)
        return self._attend(q, k, v, gate, step, keep, rotate, mask=mask)

    def _forward_unfused(self, x: torch.Tensor, qkv: torch.Tensor, gate: torch.Tensor | None, step: MixerStep,
                        keep: int, mask=None) -> torch.Tensor:
        """:meth:`forward` of a layer with K = V, normed values or one that reads a source layer's keys and values;
        ``qkv`` (B, N, (Hq + kv_sets Hkv) D) its projection without the output gate."""
        B, N, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        heads = qkv.view(B, N, Hq + self.kv_sets * Hkv, D).transpose(1, 2)  # (B, Hq [+ Hkv], N, D)
        q, k = heads.split((Hq, self.kv_sets * Hkv), dim=1)
        if self.q_norm is not None and not self.qk_norm_projection:
            q = self.q_norm(q)
        cache, read_only = step.cache, self.kv_source is not None
        if read_only:
            v = None
            if cache is None:  # the source's keys (normed, not rotated) and values of this step
                k, v = step.shared_kv[self.kv_source]
        else:
            if self.kv_sets == 2:
                k, v = k.split((Hkv, Hkv), dim=1)
            else:  # K = V: the values are the keys before their norm and rotation
                v = k
            v = v if self.value_norm_eps is None else rms_norm(v, None, eps=self.value_norm_eps)
            if self.k_norm is not None and not self.qk_norm_projection:
                k = self.k_norm(k)
            if self.shares_kv and cache is None:
                step.shared_kv[self.layer_idx] = (k, v)
        rope, rotate = self.rope, None
        if rope is not None and not (read_only and cache is not None):
            cos, sin = step.cos_sin(rope, x.device)

            def rotate(q, k):
                return self._rotate_qk(q, k, None, cos, sin)
        derive = self._keys_from_values if self.k_eq_v and not read_only else None
        return self._attend(q, k, v, gate, step, keep, rotate, read_only=read_only and cache is not None, mask=mask,
                            keys_from_values=derive)

    def _keys_from_values(self, v: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
        """K = V layers: the rotated keys of cached values (B, Hkv, S, D) at (B, S) positions, for a cache that
        stores the values alone. The values are the projection RMS-normalized without a scale and the keys the same
        normalization times the key norm's scale, rotated; with neither norm, keys and values are one tensor."""
        work = v.dtype if v.dtype in (torch.float32, torch.float64) else torch.float32
        if self.k_norm is not None:
            k = (v.to(work) * (self.k_norm.offset + self.k_norm.weight).to(work)).to(v.dtype)
        else:
            k = v.clone()  # rotated in place below
        if self.rope is None:
            return k
        emb = self.rope.emb
        R, h = emb.rotary_dim, emb.turning_pairs
        if h == R // 2:  # every pair turns
            cos, sin = self.rope.cos_sin(kv_positions, work)  # (B, S, R); empty slots (-1) at 0, masked anyway
            return apply_rotary(k, cos, sin, interleaved=emb.interleaved, kernel=self.rotary_kernel)
        # proportional RoPE: only the first h pairs turn (a quarter on Gemma 4's global layers); the rest stand
        if emb.interleaved:  # pairs (2i, 2i + 1): the first 2h channels
            cos, sin = self.rope.cos_sin(kv_positions, work, width=2 * h)
            k[..., :2 * h] = apply_rotary(k[..., :2 * h], cos, sin, interleaved=True)
            return k
        cos, sin = self.rope.cos_sin(kv_positions, work, width=h)  # pairs (i, i + R / 2), i < h
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B, 1, S, h) or (1, S, h) for positions (B, S) or (S,)
        a, b = k[..., :h].to(work, copy=True), k[..., R // 2:R // 2 + h].to(work, copy=True)  # read before written
        k[..., :h] = (a * cos - b * sin).to(k.dtype)
        k[..., R // 2:R // 2 + h] = (b * cos + a * sin).to(k.dtype)
        return k

    def _attend(self, q, k, v, gate, step: MixerStep, keep: int, rotate, *, read_only: bool = False,
                mask=None, keys_from_values=None, mask_from_view=None, value_width=None) -> torch.Tensor:
        """:func:`qkv.nn.cached_attention` of the rotated (or, by ``rotate``, to-be-rotated) heads, then the output
        gate and projection: (B, N or keep, d)."""
        B, N = q.shape[0], q.shape[2]
        cache = step.cache
        res = cached_attention(q, k, v, layer_idx=self.layer_idx, cache=cache, positions=step.positions, rope=self.rope,
                               rotate=rotate, window=self.window, mask=mask,
                               step_mask=step.self_mask(self.window) if cache is None else None,
                               score_mod=self.score_mod, position_bias=self.alibi, scale=self.scale, sinks=self.sinks,
                               attention_fn=self.attention_fn, backend=self.backend,
                               decode_backend=self.decode_backend, head_gate=self.head_gate,
                               queries_to_keep=keep, read_only=read_only, keys_from_values=keys_from_values,
                               mask_from_view=mask_from_view, value_width=value_width, owner="DecoderLM")
        n = res.out.shape[2]
        out = res.out.transpose(1, 2).reshape(B, n, self.n_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate[:, N - n:])
        return self.o_proj(out)  # (B, N or keep, d)

    def extra_repr(self) -> str:
        extra = f", window={self.window}" if self.window else ""
        extra += ", output_gate" if self.output_gate else ""
        extra += f", kv_source={self.kv_source}" if self.kv_source is not None else ""
        extra += ", k_eq_v" if self.k_eq_v else ""
        extra += ", alibi" if self.alibi is not None else ""
        extra += ", sinks" if self.sinks is not None else ""
        extra += f", score_mod={self.score_mod!r}" if self.score_mod is not None else ""
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}{extra}"
