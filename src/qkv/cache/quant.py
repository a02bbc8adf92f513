"""Quantized KV storage: KIVI int4/int2 and int8 per token, packed so the bytes really shrink.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
arXiv:2402.02750): keys have outlier *channels*, so keys are quantized per channel over a group of
``group_size`` tokens; values are quantized per token over groups of ``group_size`` channels. The
newest tokens stay in full precision (the residual): once ``residual + group_size`` tokens wait there,
the oldest ``group_size`` are quantized together and never touched again, so the cache is not
re-quantized as it grows. ``Int8()`` quantizes every token's key and value at once, per token and head.

Shape legend: B batch rows, H KV heads, N tokens, D head width, G group size, p = 8 // bits codes
per byte.

Storage per quantized element: ``bits / 8`` bytes (codes packed p to a uint8, low bits first) plus a
float16 scale and a float16 zero-point per group. The zero-point is rounded down and the scale up to
float16 before the codes are computed, so every element lies in the representable range and the
reconstruction error is at most half a step, ``scale / 2``. Both the measured error and that bound
are tracked (``cache.quant_error()``).

Attention reads dequantized keys and values (a fused kernel would read the codes; this store favours
clarity): quantization saves memory, not time, here.

Example:
    >>> import torch
    >>> from qkv.cache import KVCache, FullSpec, KIVI
    >>> cache = KVCache([FullSpec(2, 64)], quant=KIVI(bits=4, group_size=32, residual=32))
    >>> x = torch.randn(1, 2, 256, 64)
    >>> _ = cache.update(0, x, x, positions=torch.arange(256).view(1, -1))
    >>> e = cache.quant_error()
    >>> e.key_max_error <= e.key_bound and e.value_max_error <= e.value_bound
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .specs import FullSpec, element_bytes
from .storage import Store

__all__ = ["KIVI", "Int8", "QuantStore", "QuantError", "merge_errors", "pack_bits", "unpack_bits", "quantize_groups"]


class QuantError(NamedTuple):
    """Largest absolute reconstruction errors measured so far, and the half-step bounds they obey."""

    key_max_error: float
    key_bound: float
    value_max_error: float
    value_bound: float


def merge_errors(errs: list[QuantError]) -> QuantError:
    return QuantError(*(max(e[i] for e in errs) for i in range(4)))


@dataclass(frozen=True)
class KIVI:
    """KIVI: keys per channel, values per token, ``bits`` 2 or 4 (8 also accepted).

    Args:
        bits: code width; int4 packs 2 codes per byte, int2 packs 4.
        group_size: tokens per key group and channels per value group.
        residual: newest tokens kept in full precision (at least; up to ``residual + group_size - 1``).
    """

    bits: int = 4
    group_size: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in (2, 4, 8):  # 4.0 == 4 would pass `in` and fail at a write
            raise ValueError(f"KIVI(bits): expected the int 2, 4 or 8, got {self.bits!r}")
        for name in ("group_size", "residual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "group_size" else 0):
                raise ValueError(f"KIVI({name}): expected a positive int, got {value!r}")

    def store_for(self, spec: FullSpec, *, layer: str) -> Store:
        for name, d in (("head_dim", spec.head_dim), ("v_head_dim", spec.dv)):
            if d % (8 // self.bits):
                raise ValueError(f"KIVI(bits={self.bits}): {layer} has {name}={d}, not a multiple of "
                                 f"{8 // self.bits} codes per byte")
        vgroup = self.group_size if spec.dv % self.group_size == 0 else spec.dv
        return QuantStore(bits=self.bits, key_axis="channel", group=self.group_size, value_group=vgroup,
                          residual=self.residual)

    def bytes_per_element(self, head_dim: int = 128) -> float:
        """Average stored bytes per quantized element, float16 scales and zero-points included (keys: one
        pair per channel per group of tokens; values: one pair per token per group of channels)."""
        return self.bits / 8 + 4 / min(self.group_size, head_dim)

    def bytes_for(self, spec: FullSpec, tokens: int, dtype: torch.dtype | str) -> float:
        """Bytes of one row of ``tokens`` tokens: the oldest ``floor((tokens - residual) / group_size)``
        groups quantized (whatever order they arrived in), the rest in ``dtype``."""
        return _row_bytes(spec, tokens, dtype, **self._layout(spec), capacity=False)

    def allocated_for(self, spec: FullSpec, tokens: int, dtype: torch.dtype | str) -> float:
        """Bytes the store allocates for one row of ``tokens`` tokens (code and scale buffers grow by
        doubling, from 16)."""
        return _row_bytes(spec, tokens, dtype, **self._layout(spec), capacity=True)

    def _layout(self, spec: FullSpec) -> dict:
        G = self.group_size
        return dict(bits=self.bits, group=G, key_groups=True, value_group=G if spec.dv % G == 0 else spec.dv,
                    residual=self.residual)


@dataclass(frozen=True)
class Int8:
    """int8 per token: each token's key and value quantized per head as it arrives."""

    def store_for(self, spec: FullSpec, *, layer: str) -> Store:
        return QuantStore(bits=8, key_axis="token", group=spec.head_dim, value_group=spec.dv, residual=0)

    def bytes_per_element(self, head_dim: int = 128) -> float:
        """Stored bytes per element: the int8 code plus a float16 scale and zero-point per token and head."""
        return 1 + 4 / head_dim

    def bytes_for(self, spec: FullSpec, tokens: int, dtype: torch.dtype | str) -> float:
        """Bytes of one row of ``tokens`` tokens: int8 codes, and a float16 scale and zero per token, head and
        tensor (nothing stays in full precision)."""
        return _row_bytes(spec, tokens, dtype, **self._layout(spec), capacity=False)

    def allocated_for(self, spec: FullSpec, tokens: int, dtype: torch.dtype | str) -> float:
        """Bytes the store allocates for one row of ``tokens`` tokens (buffers grow by doubling, from 16)."""
        return _row_bytes(spec, tokens, dtype, **self._layout(spec), capacity=True)

    def _layout(self, spec: FullSpec) -> dict:
        return dict(bits=8, group=spec.head_dim, key_groups=False, value_group=spec.dv, residual=0)


def _row_bytes(spec: FullSpec, tokens: int, dtype, *, bits: int, group: int, key_groups: bool,
               value_group: int, residual: int, capacity: bool) -> float:
    """Bytes a :class:`QuantStore` holds (``capacity=False``) or allocates for one row of ``tokens`` tokens.
    Keys in groups of ``group`` tokens (``key_groups``) or of ``group`` channels per token; values in groups
    of ``value_group`` channels per token; the newest ``residual`` (+ < one step) tokens in ``dtype``."""
    H, D, Dv = spec.n_kv_heads, spec.head_dim, spec.dv
    step = group if key_groups else 1
    q = max(0, (tokens - residual) // step * step)

    def slots(n: int) -> int:  # _Buffer grows to max(16, the next power of two)
        return 0 if n == 0 else max(16, 1 << (n - 1).bit_length()) if capacity else n

    key_scales = slots(q // group) * H * D * 4 if key_groups else slots(q) * H * (D // group) * 4
    codes = slots(q) * H * (D + Dv) * bits / 8
    value_scales = slots(q) * H * (Dv // value_group) * 4  # a float16 scale and zero per group
    return codes + key_scales + value_scales + (tokens - q) * H * (D + Dv) * element_bytes(dtype)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last dim, ``8 // bits`` per uint8, low bits first."""
    per = 8 // bits
    c = codes.to(torch.uint8).view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: (..., D // p) uint8 -> (..., D) uint8 codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).view(*packed.shape[:-1], packed.shape[-1] * per)


def _down16(x: torch.Tensor) -> torch.Tensor:
    """float16 values <= x (x float32)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _up16(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of ``x`` with one group along ``dim`` (kept, size 1, in scale/zero).

    Returns codes (uint8, shape of x), scale and zero (float16, size 1 along ``dim``).
    """
    qmax = (1 << bits) - 1
    x32 = x.float()
    zero = _down16(x32.amin(dim, keepdim=True))
    span = x32.amax(dim, keepdim=True) - zero.float()
    scale = _up16(span / qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x32 - zero.float()) / scale.float()).clamp_(0, qmax).to(torch.uint8)
    return codes, scale, zero


class _Buffer:
    """Tensors that grow together along one dim by doubling."""

    def __init__(self, dim: int) -> None:
        self.dim, self.n, self.ts = dim, 0, None

    def append(self, *parts: torch.Tensor) -> None:
        m = parts[0].shape[self.dim]
        if self.ts is None or self.n + m > self.ts[0].shape[self.dim]:
            cap = max(16, 1 << (self.n + m - 1).bit_length())
            new = []
            for i, p in enumerate(parts):
                shape = list(p.shape)
                shape[self.dim] = cap
                t = p.new_zeros(shape) if p.dtype != torch.int64 else torch.full(shape, -1, dtype=torch.int64,
                                                                                   device=p.device)
                if self.ts is not None:
                    t.narrow(self.dim, 0, self.n).copy_(self.ts[i].narrow(self.dim, 0, self.n))
                new.append(t)
            self.ts = new
        for t, p in zip(self.ts, parts, strict=True):
            t.narrow(self.dim, self.n, m).copy_(p)
        self.n += m

    def get(self, i: int) -> torch.Tensor:
        return self.ts[i].narrow(self.dim, 0, self.n)

    def truncate(self, n: int) -> None:
        self.n = n

    def reorder(self, idx: torch.Tensor) -> None:
        if self.ts is not None:
            self.ts = [t.index_select(0, idx) for t in self.ts]

    def nbytes(self) -> int:
        return 0 if self.ts is None else sum(t.numel() * t.element_size() for t in self.ts)


class QuantStore(Store):
    """Packed codes for old tokens, full precision for the newest ``residual`` (+ < ``group``) tokens."""

    def __init__(self, *, bits: int, key_axis: str, group: int, value_group: int, residual: int) -> None:
        self.bits, self.key_axis, self.group, self.vgroup, self.residual = bits, key_axis, group, value_group, residual
        self.step = group if key_axis == "channel" else 1  # tokens quantized at once
        self.keys = _Buffer(2)  # codes (B, H, Nq, D/p)
        self.kscale = _Buffer(2)  # scale, zero: (B, H, Nq / G, D) per channel, or (B, H, Nq, D/G) per token
        self.values = _Buffer(2)  # codes (B, H, Nq, Dv/p)
        self.vscale = _Buffer(2)  # scale, zero (B, H, Nq, Dv/Gv)
        self.qpos = _Buffer(1)  # (B, Nq)
        self.rk = self.rv = self.rpos = None  # residual (B, H, R, D) in the cache dtype
        self.seen = 0
        self.err = [0.0, 0.0, 0.0, 0.0]

    @property
    def batch(self):
        return None if self.rk is None else self.rk.shape[0]

    def _quantize(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        B, H, n, D = k.shape
        Dv = v.shape[-1]
        if self.key_axis == "channel":  # groups of `group` tokens, one scale per channel
            kc, ks, kz = quantize_groups(k.view(B, H, n // self.group, self.group, D), self.bits, 3)
            ks, kz = ks.squeeze(3), kz.squeeze(3)  # (B, H, n/G, D)
            kdeq = (kc.float() * ks.unsqueeze(3).float() + kz.unsqueeze(3).float()).view(B, H, n, D)
            kc = kc.view(B, H, n, D)
        else:  # one scale per token and group of channels
            kc, ks, kz = quantize_groups(k.view(B, H, n, D // self.group, self.group), self.bits, 4)
            ks, kz = ks.squeeze(4), kz.squeeze(4)
            kdeq = (kc.float() * ks.unsqueeze(4).float() + kz.unsqueeze(4).float()).view(B, H, n, D)
            kc = kc.view(B, H, n, D)
        vc, vs, vz = quantize_groups(v.view(B, H, n, Dv // self.vgroup, self.vgroup), self.bits, 4)
        vdeq = (vc.float() * vs.float() + vz.float()).view(B, H, n, Dv)
        vs, vz, vc = vs.squeeze(4), vz.squeeze(4), vc.view(B, H, n, Dv)
        real = (pos >= 0).view(B, 1, n, 1)
        kerr = torch.where(real, (kdeq - k.float()).abs(), torch.zeros_like(kdeq))
        verr = torch.where(real, (vdeq - v.float()).abs(), torch.zeros_like(vdeq))
        self.err = [max(self.err[0], float(kerr.max())), max(self.err[1], float(ks.float().max()) / 2),
                    max(self.err[2], float(verr.max())), max(self.err[3], float(vs.float().max()) / 2)]
        self.keys.append(pack_bits(kc, self.bits))
        self.kscale.append(ks, kz)
        self.values.append(pack_bits(vc, self.bits))
        self.vscale.append(vs, vz)
        self.qpos.append(pos)

    def _dequantized(self, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.keys.n == 0:
            return None
        kc = unpack_bits(self.keys.get(0), self.bits).float()  # (B, H, Nq, D)
        ks, kz = self.kscale.get(0).float(), self.kscale.get(1).float()
        if self.key_axis == "channel":
            ks, kz = ks.repeat_interleave(self.group, dim=2), kz.repeat_interleave(self.group, dim=2)
        else:
            ks, kz = ks.repeat_interleave(self.group, dim=3), kz.repeat_interleave(self.group, dim=3)
        vc = unpack_bits(self.values.get(0), self.bits).float()
        vs = self.vscale.get(0).float().repeat_interleave(self.vgroup, dim=3)
        vz = self.vscale.get(1).float().repeat_interleave(self.vgroup, dim=3)
        return (kc * ks + kz).to(dtype), (vc * vs + vz).to(dtype)

    def write(self, k, v, pos):
        if self.rk is None:  # copies: the caller may reuse its buffers in place (decode loops, CUDA graphs)
            self.rk, self.rv, self.rpos = k.clone(), v.clone(), pos.clone()
        else:
            self.rk, self.rv = torch.cat([self.rk, k], dim=2), torch.cat([self.rv, v], dim=2)
            self.rpos = torch.cat([self.rpos, pos], dim=1)
        self.seen += k.shape[2]
        # The view is taken before quantizing: this step's queries see what was just written exactly.
        deq = self._dequantized(k.dtype)
        if deq is None:
            view = (self.rk, self.rv, self.rpos)
        else:
            view = (torch.cat([deq[0], self.rk], dim=2), torch.cat([deq[1], self.rv], dim=2),
                    torch.cat([self.qpos.get(0), self.rpos], dim=1))
        ready = (self.rk.shape[2] - self.residual) // self.step * self.step
        if ready > 0:
            self._quantize(self.rk[:, :, :ready], self.rv[:, :, :ready], self.rpos[:, :ready])
            self.rk, self.rv, self.rpos = self.rk[:, :, ready:], self.rv[:, :, ready:], self.rpos[:, ready:]
        return view

    def error(self) -> QuantError:
        return QuantError(*self.err)

    def cannot_drop(self, n):
        have = 0 if self.rk is None else self.rk.shape[2]
        if self.key_axis == "token":
            have += self.keys.n  # per-token codes can simply be truncated
        if n > have:
            return (f"a quantized layer keeps its newest {have} tokens in full precision and cannot un-quantize "
                    f"older ones; crop at most {have} (raise KIVI(residual=) for longer rollbacks)")
        return None

    def drop_last(self, n):
        if n <= 0:
            return
        from_res = min(n, self.rk.shape[2])
        keep = self.rk.shape[2] - from_res
        self.rk, self.rv, self.rpos = self.rk[:, :, :keep], self.rv[:, :, :keep], self.rpos[:, :keep]
        rest = n - from_res  # per-token layouts only (cannot_drop checked)
        if rest:
            for b in (self.keys, self.kscale, self.values, self.vscale, self.qpos):
                b.truncate(b.n - rest)
        self.seen -= n

    def reorder(self, idx):
        for b in (self.keys, self.kscale, self.values, self.vscale, self.qpos):
            b.reorder(idx)
        if self.rk is not None:
            self.rk, self.rv, self.rpos = (t.index_select(0, idx) for t in (self.rk, self.rv, self.rpos))

    def nbytes(self):
        res = sum(t.numel() * t.element_size() for t in (self.rk, self.rv) if t is not None)
        return res + sum(b.nbytes() for b in (self.keys, self.kscale, self.values, self.vscale))

    def used_bytes(self):
        """Bytes of the tokens held (codes, scales, zero-points, residual), without spare capacity."""
        total = sum(t.numel() * t.element_size() for t in (self.rk, self.rv) if t is not None)
        for b in (self.keys, self.kscale, self.values, self.vscale):
            if b.ts is not None:
                total += sum(b.get(i).numel() * b.get(i).element_size() for i in range(len(b.ts)))
        return total

    def held(self):
        return self.keys.n + (0 if self.rk is None else self.rk.shape[2])
