"""Rotary position embedding (RoPE): Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding".

Channel pairs of a query or key are rotated by angles ``position * inv_freq[f]``, so the score of a
query at ``p`` and a key at ``j`` depends on ``p - j`` only. Two layouts pair the channels differently::

    rotate-half (HF Llama, GPT-NeoX):           pairs (x[f], x[f + R/2])
    interleaved (RoFormer, GPT-J, Meta Llama):  pairs (x[2f], x[2f + 1])

Partial rotary (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``, GPT-J ``rotary_dim``) rotates
the first ``R`` channels of each head and passes the rest through.

Frequency scalings, under HF transformers' ``rope_type`` names and config fields:

- ``default``: ``inv_freq[f] = rope_theta ** (-2f / R)``.
- ``linear`` (``factor``): positional interpolation, Chen et al. 2023, "Extending Context Window of
  Large Language Models via Positional Interpolation": ``inv_freq / factor``.
- ``dynamic`` (``factor``, ``max_position_embeddings``): "dynamic NTK" scaling (community method, 2023):
  past ``max_position_embeddings`` the base grows with the current length ``L``:
  ``theta * (factor * L / max_pos - (factor - 1)) ** (R / (R - 2))``. ``L`` is ``max(positions) + 1`` of
  each call (HF keeps the largest ``L`` seen so far; the two agree whenever lengths do not shrink).
- ``yarn`` (``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
  ``attention_factor`` or ``mscale``/``mscale_all_dim``, ``truncate``): Peng et al. 2023, "YaRN: Efficient
  Context Window Extension of Large Language Models". Frequencies between the ``beta_fast`` and
  ``beta_slow`` rotation counts are blended between extrapolation and interpolation; cos/sin are scaled
  by the attention factor ``0.1 * ln(factor) + 1``.
- ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``):
  Llama 3.1 (Grattafiori et al. 2024, "The Llama 3 Herd of Models"): long wavelengths are divided by
  ``factor``, short ones kept, the band between blended smoothly.
- ``proportional`` (``partial_rotary_factor``, optional ``factor``): Gemma 4's global layers (Gemma Team 2026,
  Gemma 4 model card): every channel pair ``(f, f + D/2)`` of the whole head keeps the pairing and exponent of
  full RoPE over ``D``, ``theta ** (-2f / D)``, but only the first ``int(partial_rotary_factor * D / 2)`` pairs
  turn; the others get frequency 0 (pass through). Unlike partial rotary above, the rotated channels are spread
  over both halves of the head and their frequencies are those of the whole head.

Shape legend: B batch, H heads, N tokens, D head dim, R rotary dim (even, <= D), F = R / 2 frequencies.

Example:
    >>> import torch
    >>> from qkv.pos import RotaryEmbedding
    >>> rope = RotaryEmbedding.from_config({"head_dim": 16, "rope_theta": 10000.0,
    ...                                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    >>> q = torch.randn(1, 2, 5, 16)
    >>> rope.apply(q, torch.arange(5)).shape
    torch.Size([1, 2, 5, 16])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config.hf_config import read_rope
from ..config.rope import ROPE_TYPES, RopeParams, rope_type_of

__all__ = [
    "RotaryEmbedding", "ROPE_TYPES", "apply_rotary", "RotaryKernel", "rope", "default_inv_freq", "linear_inv_freq",
    "dynamic_ntk_inv_freq", "yarn_inv_freq", "yarn_attention_factor", "llama3_inv_freq", "proportional_inv_freq",
]


# frequency functions
def default_inv_freq(rotary_dim: int, *, theta: float = 10000.0) -> torch.Tensor:
    """``theta ** (-2f / R)`` for ``f = 0 .. R/2 - 1``: (F,) float64."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def proportional_inv_freq(head_dim: int, *, theta: float, fraction: float, factor: float = 1.0) -> torch.Tensor:
    """Proportional RoPE over a whole head of ``head_dim`` channels: ``theta ** (-2f / D) / factor`` for the first
    ``int(fraction * D / 2)`` pairs, 0 for the rest: (D/2,) float64.

    Example:
        >>> [round(f, 6) for f in proportional_inv_freq(8, theta=10000.0, fraction=0.5).tolist()]
        [1.0, 0.1, 0.0, 0.0]
    """
    turning = int(fraction * head_dim // 2)
    inv = default_inv_freq(head_dim, theta=theta) / factor
    inv[turning:] = 0.0
    return inv


def linear_inv_freq(rotary_dim: int, *, theta: float, factor: float) -> torch.Tensor:
    """Positional interpolation: positions divided by ``factor`` (equivalently, the frequencies)."""
    return default_inv_freq(rotary_dim, theta=theta) / factor


def dynamic_ntk_inv_freq(rotary_dim: int, *, theta: float, factor: float, seq_len: int,
                         max_position_embeddings: int) -> torch.Tensor:
    """Dynamic NTK: unchanged up to ``max_position_embeddings``, then a larger base for longer ``seq_len``."""
    L = max(seq_len, max_position_embeddings)
    base = theta * (factor * L / max_position_embeddings - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return default_inv_freq(rotary_dim, theta=base)


def yarn_inv_freq(rotary_dim: int, *, theta: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN "NTK-by-parts": frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), more than ``beta_fast`` times extrapolated (kept), with a
    linear ramp over the frequency index between."""

    def index_of(rotations: float) -> float:  # the frequency index f at which the count of turns is `rotations`
        return rotary_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    lo, hi = index_of(beta_fast), index_of(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001  # a step instead of a ramp
    f = torch.arange(rotary_dim // 2, dtype=torch.float64)
    interpolate = ((f - lo) / (hi - lo)).clamp(0, 1)  # 0: keep (high frequency), 1: divide by factor
    extrapolated = default_inv_freq(rotary_dim, theta=theta)
    return extrapolated * (1 - interpolate) + extrapolated / factor * interpolate


def yarn_attention_factor(factor: float, *, attention_factor: float | None = None, mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin multiplier: ``0.1 * ln(factor) + 1`` (DeepSeek's ``mscale`` variant when both
    ``mscale`` and ``mscale_all_dim`` are given; an explicit ``attention_factor`` wins)."""
    if attention_factor is not None:
        return float(attention_factor)

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, mscale) / m(factor, mscale_all_dim)
    return m(factor)


def llama3_inv_freq(rotary_dim: int, *, theta: float, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: wavelengths above ``original / low_freq_factor`` are divided by ``factor``, those below
    ``original / high_freq_factor`` kept, and the band between blended linearly in ``original / wavelength``."""
    inv = default_inv_freq(rotary_dim, theta=theta)
    wavelength = 2 * math.pi / inv
    n = original_max_position_embeddings
    smooth = ((n / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelength > n / low_freq_factor, inv / factor, blended)
    return torch.where(wavelength < n / high_freq_factor, inv, out)


# rotation
def _rotate_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The 90-degree rotation of each channel pair: (a, b) -> (-b, a)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


#: ``fn(x, cos, sin, interleaved) -> rotated x or None``: a faster :func:`apply_rotary` put into a module's
#: ``rotary_kernel`` slot from outside (``qkv.cpu.optimize``: one call from C++); None for a call it does not run.
RotaryKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], "torch.Tensor | None"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
                 kernel: RotaryKernel | None = None) -> torch.Tensor:
    """Rotate the first ``R`` channels of ``x`` by precomputed ``cos``/``sin`` (pass the rest through).

    Args:
        x: (B, H, N, D) queries or keys.
        cos, sin: (B, N, R) or (N, R) in ``x``'s layout, e.g. from :meth:`RotaryEmbedding.cos_sin`.
        interleaved: channel pairing (see the module docstring).
        kernel: a :data:`RotaryKernel` tried first (a module's ``rotary_kernel``), or None for torch's ops.

    Returns:
        (B, H, N, D) in ``x``'s dtype; float16/bfloat16 inputs rotate in float32.
    """
    R = cos.shape[-1]
    if R > x.shape[-1] or R % 2:
        raise ValueError(f"apply_rotary: rotary dim {R} must be even and <= head dim {x.shape[-1]} "
                         f"(x {tuple(x.shape)})")
    if kernel is not None:
        y = kernel(x, cos, sin, interleaved)
        if y is not None:
            return y
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads: (B, 1, N, R)
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    x_rot, x_pass = x[..., :R].to(work), x[..., R:]
    out = x_rot * cos.to(work) + _rotate_pairs(x_rot, interleaved) * sin.to(work)
    return torch.cat((out.to(x.dtype), x_pass), dim=-1) if R < x.shape[-1] else out.to(x.dtype)


def _positions(positions, n: int, device) -> torch.Tensor:
    if positions is None:
        return torch.arange(n, device=device)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"rope: positions must be an integer tensor of shape (N,) or (B, N), got {positions!r}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != n:
        raise ValueError(f"rope: positions must have shape (N,) or (B, N) with N = {n}, got {tuple(positions.shape)}")
    return positions


class RotaryEmbedding:
    """RoPE with a frequency scaling, usable as the KV cache's ``rope(x, positions)`` callable.

    A plain object, not an ``nn.Module``: it has no parameters, and its frequencies are computed once in
    float64 (per call for ``dynamic``) and moved to the input's device on use, so ``model.half()`` cannot
    degrade them. One instance can serve every layer.

    Args:
        head_dim: per-head width ``D``.
        theta: ``rope_theta``.
        rotary_dim: rotated channels ``R`` (default ``int(head_dim * partial_rotary_factor)``).
        partial_rotary_factor: fraction of ``head_dim`` to rotate.
        scaling: HF ``rope_scaling``/``rope_parameters`` dict (``rope_type`` or ``type`` plus its fields), or None.
        max_position_embeddings: the model's context length (``dynamic``; default for YaRN/Llama 3's
            ``original_max_position_embeddings`` and YaRN's ``factor``).
        interleaved: pair channels ``(2f, 2f+1)`` instead of ``(f, f + R/2)``.

    Example:
        >>> import torch
        >>> rope = RotaryEmbedding(8)
        >>> q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
        >>> s1 = rope.apply(q, torch.arange(4)) @ rope.apply(k, torch.arange(4)).transpose(-1, -2)
        >>> s2 = rope.apply(q, torch.arange(4) + 7) @ rope.apply(k, torch.arange(4) + 7).transpose(-1, -2)
        >>> torch.allclose(s1, s2, atol=1e-5)
        True
    """

    def __init__(self, head_dim: int, *, theta: float = 10000.0, rotary_dim: int | None = None,
                 partial_rotary_factor: float = 1.0, scaling: Mapping[str, Any] | None = None,
                 max_position_embeddings: int | None = None, interleaved: bool = False) -> None:
        proportional = rope_type_of(scaling) == "proportional"
        self.proportion = partial_rotary_factor if proportional else 1.0
        if proportional:  # every pair of the head takes part (those that do not turn have frequency 0)
            partial_rotary_factor, rotary_dim = 1.0, None
        R = int(head_dim * partial_rotary_factor) if rotary_dim is None else rotary_dim
        if not 0 < R <= head_dim or R % 2:
            raise ValueError(f"RotaryEmbedding: the rotary dim must be even and in (0, head_dim={head_dim}], got {R} "
                             f"(rotary_dim={rotary_dim}, partial_rotary_factor={partial_rotary_factor})")
        if theta <= 0:
            raise ValueError(f"RotaryEmbedding: rope_theta must be > 0, got {theta}")
        self.head_dim, self.rotary_dim, self.theta, self.interleaved = head_dim, R, float(theta), interleaved
        self.max_position_embeddings = max_position_embeddings
        params = dict(scaling or {})
        self.rope_type = str(params.pop("rope_type", params.pop("type", "default")))
        params.pop("rope_theta", None)
        params.pop("partial_rotary_factor", None)
        self.scaling = params
        self.attention_scaling = 1.0
        self._base = self._inv_freq_for(None)  # (F,) float64 on CPU
        self._by_device: dict[tuple[torch.device, int | None], torch.Tensor] = {}

    @property
    def turning_pairs(self) -> int:
        """How many of the ``rotary_dim / 2`` channel pairs turn (a nonzero frequency): all of them but under
        proportional RoPE, where the first ``partial_rotary_factor`` of the head's pairs do and the rest stand."""
        return int(torch.count_nonzero(self._base))

    # construction from configs
    @classmethod
    def from_config(cls, config, *, layer_type: str | None = None, interleaved: bool = False) -> RotaryEmbedding:
        """Build from an HF config object or a dict with HF field names.

        Reads ``head_dim`` (or ``hidden_size // num_attention_heads``), ``rope_theta``,
        ``partial_rotary_factor`` / ``rotary_dim``, ``rope_parameters`` or ``rope_scaling`` (for
        per-layer-type dicts, as in Gemma 3, pass ``layer_type``) and ``max_position_embeddings``.
        """
        get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
        head_dim = get("head_dim") or (get("hidden_size") // get("num_attention_heads")
                                       if get("hidden_size") and get("num_attention_heads") else None)
        if not head_dim:
            raise ValueError("RotaryEmbedding.from_config: the config needs head_dim, or hidden_size and "
                             "num_attention_heads")
        nested = get("rope_parameters")
        if layer_type is not None and not (isinstance(nested, Mapping) and layer_type in nested):
            raise ValueError(f"RotaryEmbedding.from_config: no rope parameters for layer_type {layer_type!r}; "
                             f"the config has {sorted(nested or {})}")
        keys = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
        rope = read_rope({k: get(k) for k in keys if get(k) is not None}, (layer_type,) if layer_type else ())
        params = rope[layer_type or "full_attention"]
        return cls(head_dim, theta=params.theta, rotary_dim=get("rotary_dim"),
                   partial_rotary_factor=params.partial_rotary_factor, scaling=params.scaling,
                   max_position_embeddings=get("max_position_embeddings"), interleaved=interleaved)

    @classmethod
    def from_params(cls, params: RopeParams, head_dim: int, max_position_embeddings: int | None = None,
                    ) -> RotaryEmbedding:
        """Build from :class:`qkv.config.RopeParams` (the model description's RoPE) for heads of ``head_dim``.

        Example:
            >>> from qkv.config import RopeParams
            >>> RotaryEmbedding.from_params(RopeParams(theta=500.0), 8).theta
            500.0
        """
        return cls(head_dim, theta=params.theta, partial_rotary_factor=params.partial_rotary_factor,
                   scaling=dict(params.scaling) if params.scaling else None,
                   max_position_embeddings=max_position_embeddings, interleaved=params.interleaved)

    def _need(self, key: str, default=None):
        value = self.scaling.get(key, default)
        if value is None:
            raise ValueError(f"RotaryEmbedding: rope_type {self.rope_type!r} needs {key!r} in rope_scaling; got "
                             f"{self.scaling}")
        return value

    def _inv_freq_for(self, seq_len: int | None) -> torch.Tensor:
        R, theta, t = self.rotary_dim, self.theta, self.rope_type
        if t == "default":
            return default_inv_freq(R, theta=theta)
        if t == "linear":
            return linear_inv_freq(R, theta=theta, factor=float(self._need("factor")))
        if t == "dynamic":
            max_pos = self._need("max_position_embeddings", self.max_position_embeddings)
            return dynamic_ntk_inv_freq(R, theta=theta, factor=float(self._need("factor")), seq_len=seq_len or 0,
                                        max_position_embeddings=int(max_pos))
        if t == "yarn":
            original = int(self._need("original_max_position_embeddings", self.max_position_embeddings))
            factor = self.scaling.get("factor")
            if factor is None:
                factor = self._need("max_position_embeddings", self.max_position_embeddings) / original
            self.attention_scaling = yarn_attention_factor(
                float(factor), attention_factor=self.scaling.get("attention_factor"),
                mscale=self.scaling.get("mscale"), mscale_all_dim=self.scaling.get("mscale_all_dim"))
            return yarn_inv_freq(R, theta=theta, factor=float(factor), original_max_position_embeddings=original,
                                 beta_fast=float(self.scaling.get("beta_fast") or 32),
                                 beta_slow=float(self.scaling.get("beta_slow") or 1),
                                 truncate=bool(self.scaling.get("truncate", True)))
        if t == "llama3":
            return llama3_inv_freq(
                R, theta=theta, factor=float(self._need("factor")),
                low_freq_factor=float(self._need("low_freq_factor")),
                high_freq_factor=float(self._need("high_freq_factor")),
                original_max_position_embeddings=int(self._need("original_max_position_embeddings",
                                                                self.max_position_embeddings)))
        if t == "proportional":
            return proportional_inv_freq(R, theta=theta, fraction=self.proportion,
                                         factor=float(self.scaling.get("factor") or 1.0))
        raise ValueError(f"RotaryEmbedding: unsupported rope_type {t!r}; supported: {', '.join(ROPE_TYPES)}")

    # the math
    def inv_freq(self, seq_len: int | None = None, *, device=None) -> torch.Tensor:
        """(F,) float64 inverse frequencies; ``seq_len`` matters only for ``dynamic``."""
        dynamic = self.rope_type == "dynamic" and seq_len is not None and seq_len > self._dynamic_limit()
        key = (torch.device(device or "cpu"), seq_len if dynamic else None)
        if key not in self._by_device:
            if len(self._by_device) > 16:
                self._by_device.clear()
            self._by_device[key] = (self._inv_freq_for(seq_len) if dynamic else self._base).to(key[0])
        return self._by_device[key]

    def _dynamic_limit(self) -> int:
        return int(self.scaling.get("max_position_embeddings") or self.max_position_embeddings or 0)

    def cos_sin(self, positions: torch.Tensor, *,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosines and sines at ``positions`` in this embedding's layout, times the attention scaling.

        Args:
            positions: (N,) or (B, N) integer positions; negative ones (padding) act as position 0.
            dtype: output dtype (angles are computed in float64).

        Returns:
            ``(cos, sin)``, each ``positions.shape + (R,)``. For the rotate-half layout this equals HF's
            ``LlamaRotaryEmbedding`` output (``cat(freqs, freqs)``).
        """
        pos = positions.clamp_min(0)
        seq_len = int(pos.max()) + 1 if self.rope_type == "dynamic" and pos.numel() else None
        inv = self.inv_freq(seq_len, device=pos.device)
        angle = pos.to(torch.float64).unsqueeze(-1) * inv  # (..., F)
        angle = angle.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((angle, angle), dim=-1)
        return (angle.cos() * self.attention_scaling).to(dtype), (angle.sin() * self.attention_scaling).to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` (B, H, N, D) to ``positions`` ((N,) or (B, N); default ``0 .. N-1``).

        This bound method is a valid ``rope(x, positions)`` callable for ``cache.update``.
        """
        pos = _positions(positions, x.shape[-2], x.device)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(pos.to(x.device), dtype=work)
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)

    __call__ = apply

    def __repr__(self) -> str:
        extra = f", scaling={self.scaling}" if self.scaling else ""
        return (f"RotaryEmbedding(head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta:g}, "
                f"rope_type={self.rope_type!r}, interleaved={self.interleaved}{extra})")


def rope(x: torch.Tensor, positions: torch.Tensor | None = None, *, theta: float = 10000.0,
         rotary_dim: int | None = None, interleaved: bool = False) -> torch.Tensor:
    """Plain RoPE (no scaling) as one function: ``x`` (B, H, N, D) rotated to ``positions`` (N,) or (B, N).

    Example:
        >>> import torch
        >>> x = torch.randn(1, 2, 3, 8)
        >>> torch.equal(rope(x, torch.zeros(3, dtype=torch.long)), x)
        True
    """
    emb = RotaryEmbedding(x.shape[-1], theta=theta, rotary_dim=rotary_dim, interleaved=interleaved)
    return emb.apply(x, positions)
