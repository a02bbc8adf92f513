"""The recurrent ("linear attention") token mixer of a hybrid decoder's ``linear_attention`` layers, as data.

Hybrid models interleave softmax attention layers with recurrent layers whose state does not grow with the
context: Qwen3-Next and Qwen3.5 put three Gated DeltaNet layers (Yang, Kautz, Hatamizadeh 2025,
arXiv:2412.06464) before each full-attention layer. :class:`LinearAttentionConfig` holds the mixer's shape under
HF's field names; :class:`qkv.nn.DecoderLM` builds the module (:mod:`qkv.nn.gated_deltanet`) and
:func:`qkv.cache.describe.cache_specs_of` its cache spec (a ``RecurrentSpec``: the short convolution's last
``K - 1`` inputs and a ``(Dk, Dv)`` state per value head).

Mixers (``mixer``):

- ``"gated_deltanet"``: Qwen3-Next's projections, ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head;
- ``"gated_deltanet_split"``: Qwen3.5's, ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``;
- ``"kda"``: Kimi Delta Attention (Kimi Team 2025, arXiv:2510.26692; :class:`qkv.nn.KimiDeltaAttention`), the gated
  delta rule with one decay per key channel: as many key as value heads, keys as wide as values (Kimi Linear's
  ``linear_num_heads`` and ``linear_head_dim``).

Example:
    >>> c = LinearAttentionConfig(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    ...                           linear_value_head_dim=16)
    >>> c.recurrent_shape()   # conv channels, taps, value heads, Dk, Dv
    (96, 4, 4, 8, 16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .mixers import recurrent_mixers

__all__ = ["LinearAttentionConfig", "LINEAR_MIXERS"]

#: The recurrent mixers a ``linear_attention`` layer may hold (those of :mod:`qkv.config.mixers` at import; a kind
#: registered later is accepted too).
LINEAR_MIXERS = recurrent_mixers()


@dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
    """Shape of the recurrent mixer of every ``linear_attention`` layer (HF Qwen3-Next field names; Kimi Linear's
    ``linear_num_heads`` is both head counts, its ``linear_head_dim`` both widths).

    Args:
        mixer: a recurrent kind of :data:`qkv.config.mixers.MIXERS` (:data:`LINEAR_MIXERS`).
        linear_num_key_heads: query/key heads ``Hk``.
        linear_num_value_heads: value heads ``H``, a multiple of ``Hk`` (each key head serves ``H / Hk``).
        linear_key_head_dim, linear_value_head_dim: ``Dk`` and ``Dv``.
        linear_conv_kernel_dim: taps ``K`` of the short causal convolution over q, k and v.
        allow_neg_eigval: the write strength is ``2 * sigmoid(b)``, in ``[0, 2]``, so the transition
            ``I - beta k k^T`` may have the eigenvalue ``1 - beta < 0`` (Grazzi et al. 2025, "Unlocking State-Tracking
            in Linear RNNs Through Negative Eigenvalues", arXiv:2411.12537; OLMo-hybrid); False: ``sigmoid(b)``.
        norm_eps: epsilon of the gated output norm (None: the model's ``rms_norm_eps``; OLMo-hybrid fixes 1e-5).
    """

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    mixer: str = "gated_deltanet"
    allow_neg_eigval: bool = False
    norm_eps: float | None = None

    def __post_init__(self) -> None:
        if self.mixer not in recurrent_mixers():
            raise ValueError(f"LinearAttentionConfig: mixer must be one of the recurrent kinds of qkv.config.mixers, "
                             f"{recurrent_mixers()}, got {self.mixer!r}")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LinearAttentionConfig: {name} must be a positive int, got {v!r}")
        if not isinstance(self.allow_neg_eigval, bool):
            raise TypeError(f"LinearAttentionConfig: allow_neg_eigval must be True or False, got "
                            f"{self.allow_neg_eigval!r}")
        if self.allow_neg_eigval and self.mixer == "kda":
            raise ValueError("LinearAttentionConfig: allow_neg_eigval is an option of the gated_deltanet mixers; kda "
                             "keeps beta = sigmoid(b)")
        if self.norm_eps is not None and not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"LinearAttentionConfig: norm_eps must be a positive float or None, got {self.norm_eps!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"LinearAttentionConfig: linear_num_value_heads={self.linear_num_value_heads} must be a "
                             f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
        if self.mixer == "kda" and (self.linear_num_key_heads != self.linear_num_value_heads
                                    or self.linear_key_head_dim != self.linear_value_head_dim):
            raise ValueError(f"LinearAttentionConfig: the kda mixer has as many key as value heads, each as wide; got "
                             f"{self.linear_num_key_heads} key and {self.linear_num_value_heads} value heads of "
                             f"{self.linear_key_head_dim} and {self.linear_value_head_dim} channels")

    def recurrent_shape(self) -> tuple[int, int, int, int, int]:
        """``(conv channels, conv taps, value heads, Dk, Dv)``: what a ``RecurrentSpec`` of this layer holds."""
        Hk, H = self.linear_num_key_heads, self.linear_num_value_heads
        Dk, Dv = self.linear_key_head_dim, self.linear_value_head_dim
        return 2 * Hk * Dk + H * Dv, self.linear_conv_kernel_dim, H, Dk, Dv

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, mixer: str = "gated_deltanet", allow_neg_eigval: bool = False,
                norm_eps: float | None = None) -> LinearAttentionConfig:
        """From an HF Qwen3-Next / Qwen3.5 text config dict (HF's defaults for absent keys); for ``mixer="kda"`` a
        Kimi Linear one as :func:`qkv.config.hf_config.hf_defaults` leaves it (``linear_attn_config`` read).
        ``allow_neg_eigval`` and ``norm_eps`` as the fields (the HF reader gives OLMo-hybrid's)."""
        if mixer == "kda":
            heads, width = cfg.get("linear_num_heads", 32), cfg.get("linear_head_dim", 128)
            return cls(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=width,
                       linear_value_head_dim=width, linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
                       mixer=mixer)
        return cls(linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
                   linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
                   linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
                   linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
                   linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4), mixer=mixer,
                   allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps)
