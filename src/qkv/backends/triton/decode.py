"""Decode kernels: one query token per row over a paged KV cache, and MLA's absorbed decode over the
latent cache, both split along the keys (split-KV, "Flash-Decoding") and merged by log-sum-exp.

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention";
DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model"
(multi-head latent attention; the absorbed form attends in the latent space).

Shape legend: B rows, Hq/Hkv heads, G = Hq // Hkv, P pool blocks, T block size, NB blocks per row,
S cache slots, D/Dv head dims, r latent rank, dr RoPE width, NS splits.

Masking is by position, as ``qkv.masks.positions(q_pos, kv_pos, causal=True, window=W)``: a slot is
visible when its position is ``>= 0``, ``<= q_pos`` and, with a window, ``q_pos - kv_pos < W``. A row
with no visible slot returns zeros and ``lse = -inf``. Inference only (no autograd).

Example (needs a CUDA GPU, or ``TRITON_INTERPRET=1`` before triton is imported):
    >>> import torch
    >>> from qkv.backends.triton.decode import paged_decode  # doctest: +SKIP
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..paged import check_paged_args

__all__ = ["paged_decode", "mla_decode", "merge_splits"]


@triton.jit(do_not_specialize=["NB", "blocks_per_split"])
def _paged_decode_kernel(Q, KP, VP, TABLE, KPOS, QPOS, O_PART, L_PART,
                         sq_b, sq_h, sk_p, sk_h, sk_t, sv_p, sv_h, sv_t, st_b, skp_b,
                         Hq, Hkv, G, T, NB, D, DV, scale, window, blocks_per_split, NS,
                         HAS_WINDOW: tl.constexpr, PREC: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr,
                         PAGES: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    offs_g = tl.arange(0, BG)
    offs_c = tl.arange(0, PAGES * BT)  # a tile of PAGES blocks: column c is slot c % BT of block c // BT
    page = offs_c // BT
    offs_t = offs_c % BT
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    h = hk * G + offs_g  # the G query heads of this kv head
    gmask = offs_g < G
    q = tl.load(Q + b.to(tl.int64) * sq_b + h[:, None].to(tl.int64) * sq_h + offs_d[None, :],
                mask=gmask[:, None] & (offs_d < D)[None, :], other=0.0)  # [BG, BD]
    qpos = tl.load(QPOS + b)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    j0 = split * blocks_per_split
    j1 = tl.minimum(j0 + blocks_per_split, NB)
    for j in range(j0, j1, PAGES):
        jp = j + page  # [PAGES * BT] the block of each column
        tmask = (offs_t < T) & (jp < j1)
        blk = tl.load(TABLE + b.to(tl.int64) * st_b + jp, mask=jp < j1, other=0).to(tl.int64)
        kpos = tl.load(KPOS + b.to(tl.int64) * skp_b + jp * T + offs_t, mask=tmask, other=-1)
        ok = tmask & (kpos >= 0) & (kpos <= qpos)
        if HAS_WINDOW:
            ok = ok & (qpos - kpos < window)
        k = tl.load(KP + blk[None, :] * sk_p + hk.to(tl.int64) * sk_h + offs_t[None, :] * sk_t + offs_d[:, None],
                    mask=tmask[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, PAGES * BT]
        if PREC == 2:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * scale
        elif PREC == 1:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale  # [BG, BT]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VP + blk[:, None] * sv_p + hk.to(tl.int64) * sv_h + offs_t[:, None] * sv_t + offs_dv[None, :],
                    mask=tmask[:, None] & (offs_dv < DV)[None, :], other=0.0)  # [PAGES * BT, BDV]
        if PREC == 2:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif PREC == 1:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (b * Hq + h).to(tl.int64) * NS + split  # [BG]
    tl.store(O_PART + row[:, None] * DV + offs_dv[None, :], out, mask=gmask[:, None] & (offs_dv < DV)[None, :])
    tl.store(L_PART + row, lse, mask=gmask)


@triton.jit(do_not_specialize=["S", "slots_per_split"])
def _mla_decode_kernel(QL, QR, C, R, KPOS, QPOS, O_PART, L_PART,
                       sql_b, sql_h, sqr_b, sqr_h, sc_b, sc_s, sr_b, sr_s, skp_b,
                       H, S, RANK, DR, scale, slots_per_split, NS,
                       PREC: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr,
                       BDR: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    offs_h = tl.arange(0, BH)
    offs_s = tl.arange(0, BS)
    offs_r = tl.arange(0, BR)
    offs_e = tl.arange(0, BDR)
    hmask = offs_h < H
    ql = tl.load(QL + b.to(tl.int64) * sql_b + offs_h[:, None] * sql_h + offs_r[None, :],
                 mask=hmask[:, None] & (offs_r < RANK)[None, :], other=0.0)  # [BH, BR]
    qr = tl.load(QR + b.to(tl.int64) * sqr_b + offs_h[:, None] * sqr_h + offs_e[None, :],
                 mask=hmask[:, None] & (offs_e < DR)[None, :], other=0.0)  # [BH, BDR]
    qpos = tl.load(QPOS + b)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BR], tl.float32)
    s0 = split * slots_per_split
    s1 = tl.minimum(s0 + slots_per_split, S)
    for start in range(s0, s1, BS):
        slot = start + offs_s
        smask = slot < s1
        kpos = tl.load(KPOS + b.to(tl.int64) * skp_b + slot, mask=smask, other=-1)
        ok = smask & (kpos >= 0) & (kpos <= qpos)
        c = tl.load(C + b.to(tl.int64) * sc_b + slot[:, None].to(tl.int64) * sc_s + offs_r[None, :],
                    mask=smask[:, None] & (offs_r < RANK)[None, :], other=0.0)  # [BS, BR]
        kr = tl.load(R + b.to(tl.int64) * sr_b + slot[:, None].to(tl.int64) * sr_s + offs_e[None, :],
                     mask=smask[:, None] & (offs_e < DR)[None, :], other=0.0)  # [BS, BDR]
        if PREC == 2:
            c32 = c.to(tl.float32)
            s = tl.dot(ql.to(tl.float32), tl.trans(c32), input_precision="ieee")
            s += tl.dot(qr.to(tl.float32), tl.trans(kr.to(tl.float32)), input_precision="ieee")
        elif PREC == 1:
            s = tl.dot(ql, tl.trans(c), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
        else:
            s = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))  # [BH, BS]
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PREC == 2:
            pv = tl.dot(p, c.to(tl.float32), input_precision="ieee")
        elif PREC == 1:
            pv = tl.dot(p, c, input_precision="ieee")
        else:
            pv = tl.dot(p.to(c.dtype), c)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (b * H + offs_h).to(tl.int64) * NS + split
    tl.store(O_PART + row[:, None] * RANK + offs_r[None, :], out, mask=hmask[:, None] & (offs_r < RANK)[None, :])
    tl.store(L_PART + row, lse, mask=hmask)


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


def _prec(t: torch.Tensor) -> int:
    if t.dtype == torch.float32:
        return 1
    return 2 if t.device.type == "cpu" and t.dtype == torch.bfloat16 else 0


@triton.jit
def _merge_kernel(O_PART, L_PART, OUT, LSE, NS, DV, BS: tl.constexpr, BDV: tl.constexpr):
    """One row: ``lse = logsumexp_s l_s``, ``out = sum_s exp(l_s - lse) o_s`` (a row whose splits all saw
    nothing gives 0 and -inf)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BS)
    offs_dv = tl.arange(0, BDV)
    smask = offs_s < NS
    lp = tl.load(L_PART + row * NS + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lp, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lp - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    has = total > 0
    lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    o = tl.load(O_PART + (row * NS + offs_s[:, None]) * DV + offs_dv[None, :],
                mask=smask[:, None] & (offs_dv < DV)[None, :], other=0.0)  # [BS, BDV]
    out = tl.sum(o * (w / tl.where(has, total, 1.0))[:, None], 0)
    tl.store(OUT + row * DV + offs_dv, out.to(OUT.dtype.element_ty), mask=offs_dv < DV)
    tl.store(LSE + row, lse)


def merge_splits(o_part: torch.Tensor, l_part: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-split results ``o_part (..., NS, Dv)`` float32, ``l_part (..., NS)`` by log-sum-exp in one
    launch: ``lse = logsumexp_s l_s``, ``out = sum_s exp(l_s - lse) o_s``; rows with no visible slot give 0, -inf."""
    *lead, ns, dv = o_part.shape
    rows = math.prod(lead)
    out = torch.empty(*lead, dv, dtype=dtype, device=o_part.device)
    lse = torch.empty(*lead, dtype=torch.float32, device=o_part.device)
    if rows:
        _merge_kernel[(rows,)](o_part.contiguous(), l_part.contiguous(), out, lse, ns, dv,
                               BS=max(2, 1 << (ns - 1).bit_length()), BDV=_pow2(dv))
    return out, lse


#: Launch settings of the paged decode kernel on CUDA: keys per tile (whole blocks gathered into one tile, so each
#: loop step issues several blocks' loads at once), programs per SM the key splits aim for, warps and stages
#: (benchmarks/gpu_tune.py's sweep on an H200: every 128-key setting within 2% of the fastest, 64-key ones
#: spread over 30%).
DECODE_TILE_KEYS, DECODE_WAVES, DECODE_WARPS, DECODE_STAGES = 128, 2, 4, 3


def _splits(n_units: int, programs: int, device: torch.device, splits: int | None, waves: int = 2) -> int:
    if splits is not None:
        return max(1, min(splits, n_units))
    if device.type != "cuda":
        return max(1, min(2, n_units))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_units, math.ceil(waves * sms / max(1, programs))))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 kv_positions: torch.Tensor, q_positions: torch.Tensor, *, scale: float | None = None,
                 window: int | None = None, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over a paged KV cache.

    Args:
        q: (B, Hq, D) the step's queries.
        k_pool: (P, Hkv, T, D) and v_pool (P, Hkv, T, Dv): the layer's block pools.
        block_tables: (B, NB) integer block ids per row (any filler block for unused entries).
        kv_positions: (B, NB * T) integer position of each slot in table order, ``-1`` where empty.
        q_positions: (B,) integer position of each row's query.
        scale: default ``D ** -0.5``.
        window: keep slots with ``q_pos - kv_pos < window`` (HF ``sliding_window``), or None.
        splits: key splits per row (default: enough programs to fill the GPU).

    Returns:
        out (B, Hq, Dv) in q's dtype and lse (B, Hq) float32.
    """
    check_paged_args("paged_decode", q, k_pool, v_pool, block_tables, kv_positions, q_positions)
    B, Hq, D = q.shape
    Hkv, T = k_pool.shape[1], k_pool.shape[2]
    NB = block_tables.shape[1]
    Dv, G = v_pool.shape[3], Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    q = q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    v_pool = v_pool if v_pool.stride(-1) == 1 else v_pool.contiguous()
    table = block_tables.to(torch.int32).contiguous()
    kpos = kv_positions.to(torch.int64).contiguous()
    qpos = q_positions.to(torch.int64).contiguous()
    cuda = q.device.type == "cuda"
    BT = _pow2(T)
    pages = max(1, DECODE_TILE_KEYS // BT) if cuda else 2  # the interpreter: two blocks a tile, so tiles split
    ns = _splits(max(NB, 1), B * Hkv, q.device, splits, DECODE_WAVES)
    per = math.ceil(max(NB, 1) / ns)
    launch = dict(num_warps=DECODE_WARPS, num_stages=DECODE_STAGES) if cuda else {}
    o_part = torch.empty(B, Hq, ns, Dv, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, ns, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B * Hkv, ns)](
        q, k_pool, v_pool, table, kpos, qpos, o_part, l_part,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), table.stride(0), kpos.stride(0),
        Hq, Hkv, G, T, NB, D, Dv, scale, int(window or 0), per, ns,
        HAS_WINDOW=window is not None, PREC=_prec(q), BG=_pow2(G), BT=BT, PAGES=pages, BD=_pow2(D), BDV=_pow2(Dv),
        **launch)
    return merge_splits(o_part, l_part, q.dtype)


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
               kv_positions: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA absorbed decode: every head attends ``[q_lat | q_rope]`` over ``[c_kv | k_rope]`` with the
    latent ``c_kv`` as the value (the caller applies W_UK before and W_UV after).

    Args:
        q_lat: (B, H, r) queries absorbed into the latent space; q_rope (B, H, dr).
        c_kv: (B, S, r) latent cache; k_rope (B, S, dr) rotated RoPE keys.
        kv_positions: (B, S) slot positions (``-1`` empty); q_positions (B,).
        scale: the softmax scale (MLA's ``(d_nope + d_rope) ** -0.5`` times any YaRN factor).

    Returns:
        o_lat (B, H, r) in q's dtype and lse (B, H) float32.
    """
    B, H, r = q_lat.shape
    S, dr = c_kv.shape[1], k_rope.shape[2]
    if q_rope.shape[:2] != (B, H) or c_kv.shape != (B, S, r) or k_rope.shape[:2] != (B, S) or q_rope.shape[2] != dr:
        raise ValueError(f"mla_decode: q_lat {tuple(q_lat.shape)}, q_rope {tuple(q_rope.shape)}, c_kv "
                         f"{tuple(c_kv.shape)}, k_rope {tuple(k_rope.shape)} disagree: need (B, H, r), (B, H, dr), "
                         "(B, S, r), (B, S, dr)")
    ql, qr = q_lat.contiguous(), q_rope.contiguous()
    c = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
    kr = k_rope if k_rope.stride(-1) == 1 else k_rope.contiguous()
    kpos = kv_positions.to(torch.int64).contiguous()
    qpos = q_positions.to(torch.int64).contiguous()
    bs = 16 if q_lat.device.type == "cpu" else 32
    ns = _splits(max(1, math.ceil(S / bs)), B, q_lat.device, splits)
    per = math.ceil(max(S, 1) / ns / bs) * bs
    o_part = torch.empty(B, H, ns, r, dtype=torch.float32, device=q_lat.device)
    l_part = torch.empty(B, H, ns, dtype=torch.float32, device=q_lat.device)
    _mla_decode_kernel[(B, ns)](
        ql, qr, c, kr, kpos, qpos, o_part, l_part,
        ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1), c.stride(0), c.stride(1), kr.stride(0), kr.stride(1),
        kpos.stride(0), H, S, r, dr, float(scale), per, ns,
        PREC=_prec(q_lat), BH=_pow2(H), BS=bs, BR=_pow2(r), BDR=_pow2(dr))
    return merge_splits(o_part, l_part, q_lat.dtype)
