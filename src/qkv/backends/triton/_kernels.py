"""Triton kernels of the attention operator: FlashAttention-2 forward, and a backward in two kernels.

Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning"
(online softmax over key tiles, one program per query tile; the backward recomputes probabilities
from the saved log-sum-exp, ``dS = P * (dP - delta)``, with one kernel for dK/dV per key tile and
one for dQ per query tile, so no atomics).

Shape legend: BM/BN query/key tile, BD/BDV padded head dims, TQ/TK tile counts, Bm mask batch (1 or B).

Tiles come from lists built on the host from the mask's block map (``_lower.py``): for each query
tile (forward, dQ) or key tile (dK/dV), the count of visited tiles, their ids and a kind per slot:
``-1`` FULL (no mask arithmetic), ``>= 0`` PARTIAL (the mask is evaluated: analytically in the
kernel, or read from the slot's dense tile ``TILES[kind]``). EMPTY tiles are not listed.

Score modifiers are applied in the kernel: ALiBi and a tensor bias (each before or after softcap,
``*_POS`` 1 or 2), then softcap. Dropout recomputes the keep decision from (seed, b, h, q, k) with the
same 64-bit counter hash as ``qkv._dropout``.
"""

from __future__ import annotations

import triton
import triton.language as tl

_M32 = 0xFFFFFFFF


@triton.jit
def _tanh(x):
    # libdevice.tanh has no interpreter implementation; a series near 0 avoids cancellation.
    ax = tl.abs(x)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    return tl.where(ax < 0.25, series, tl.where(x < 0, -big, big))


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b accumulated in float32. PREC 0: the inputs' tensor-core precision; 1: IEEE float32 (float32
    inputs, no TF32); 2: both upcast to float32 first (bfloat16 under the interpreter, whose bfloat16 dot is
    wrong; products of bfloat16 values are exact in float32, so the arithmetic is the same)."""
    if PREC == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PREC == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _keep(seed, threshold, b, h, H, offs_m, offs_n, Nq, Nk):
    """Dropout keep mask [BM, BN]: ``qkv._dropout.keep_mask`` on int64 counters."""
    base = (b.to(tl.int64) * H + h) * Nq
    counter = (base + offs_m.to(tl.int64)[:, None]) * Nk + offs_n.to(tl.int64)[None, :]
    lo = counter & 0xFFFFFFFF
    hi = counter >> 32
    u = _mix32(lo ^ _mix32(hi ^ seed))
    return u >= threshold


@triton.jit
def _allowed(kind, b, h, offs_m, offs_n, Nq, Nk,
             band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX, s_prefix,
             TILES, s_tile, s_tile_h,
             MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
             HAS_PREFIX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Allowed pairs of a tile [BM, BN], bounds included. Called on PARTIAL tiles and on FULL tiles cut
    short by Nk (``kind`` -1), where the mask allows every in-bounds pair anyway."""
    ok = (offs_m < Nq)[:, None] & (offs_n < Nk)[None, :]
    if MASK_KIND == 1:  # analytic: band & key length & same document, or key in the prefix
        rel = offs_n[None, :] - offs_m[:, None]  # k - q
        base = ok
        if HAS_BAND:
            base = base & (rel >= band_lo) & (rel <= band_hi)
        if HAS_KVLEN:
            n = tl.load(KVLEN + b * s_kvlen)
            base = base & (offs_n < n)[None, :]
        if HAS_DOC:
            qd = tl.load(QID + b * s_qid + offs_m, mask=offs_m < Nq, other=-1)
            kd = tl.load(KID + b * s_kid + offs_n, mask=offs_n < Nk, other=-2)
            base = base & (qd[:, None] == kd[None, :])
        if HAS_PREFIX:
            p = tl.load(PREFIX + b * s_prefix)
            base = base | (ok & (offs_n < p)[None, :])
        ok = base
    elif MASK_KIND == 2:  # dense tile of the partial slot
        r = tl.arange(0, BM)
        c = tl.arange(0, BN)
        t = tl.load(TILES + tl.maximum(kind, 0).to(tl.int64) * s_tile + h * s_tile_h + r[:, None] * BN + c[None, :])
        ok = ok & ((t != 0) | (kind < 0))  # a FULL slot (kind -1) cut short by Nk: bounds only
    return ok


@triton.jit
def _modify(s, b, h, offs_m, offs_n, Nq, Nk, SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap,
            ALIBI_POS: tl.constexpr, ALIBI_BIDIR: tl.constexpr, BIAS_POS: tl.constexpr, HAS_CAP: tl.constexpr):
    """Scores after the modifiers, and tanh of the pre-cap score (for the backward's chain rule)."""
    alibi = tl.zeros_like(s)
    if ALIBI_POS != 0:
        slope = tl.load(SLOPES + h * s_slope)
        dist = ((offs_m + (Nk - Nq))[:, None] - offs_n[None, :]).to(tl.float32)
        if ALIBI_BIDIR:
            dist = tl.abs(dist)
        alibi = -slope * dist
    bias = tl.zeros_like(s)
    if BIAS_POS != 0:
        inb = (offs_m < Nq)[:, None] & (offs_n < Nk)[None, :]
        ptr = BIAS + b * sb_b + h * sb_h + offs_m[:, None].to(tl.int64) * sb_q + offs_n[None, :].to(tl.int64) * sb_k
        bias = tl.load(ptr, mask=inb, other=0.0).to(tl.float32)
    if ALIBI_POS == 1:
        s = s + alibi
    if BIAS_POS == 1:
        s = s + bias
    t = tl.zeros_like(s)
    if HAS_CAP:
        t = _tanh(s / cap)
        s = cap * t
    if ALIBI_POS == 2:
        s = s + alibi
    if BIAS_POS == 2:
        s = s + bias
    return s, t


@triton.jit(do_not_specialize=["seed", "threshold", "Nq", "Nk"])
def attn_fwd(Q, K, V, O, LSE,
             sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
             Hq, G, Nq, Nk, D, DV, scale,
             NUM, IDX, KIND, s_lb, s_lt, TK_L,
             band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX, s_prefix, TILES, s_tile, s_tile_h,
             SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap, seed, threshold, keep_scale,
             MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
             HAS_PREFIX: tl.constexpr, TILE_HEADS: tl.constexpr,
             ALIBI_POS: tl.constexpr, ALIBI_BIDIR: tl.constexpr, BIAS_POS: tl.constexpr, HAS_CAP: tl.constexpr,
             HAS_DROP: tl.constexpr, PREC: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    if HEAVY_FIRST:  # last query tiles first: under a causal mask they hold the most key tiles (less tail)
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G
    th = h if TILE_HEADS else 0
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q_ptr = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * sq_n + offs_d[None, :],
                mask=(offs_m < Nq)[:, None] & (offs_d < D)[None, :], other=0.0)  # [BM, BD]
    k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    row = b * s_lb + pid_m * s_lt
    n_tiles = tl.load(NUM + row)
    for i in range(0, n_tiles):
        kt = tl.load(IDX + row * TK_L + i)
        kind = tl.load(KIND + row * TK_L + i)
        offs_n = kt * BN + tl.arange(0, BN)
        k = tl.load(k_base + offs_n[None, :].to(tl.int64) * sk_n + offs_d[:, None],
                    mask=(offs_n < Nk)[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, BN]
        s = _dot(q, k, PREC) * scale  # [BM, BN] float32
        s, _t = _modify(s, b, h, offs_m, offs_n, Nq, Nk, SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap,
                        ALIBI_POS, ALIBI_BIDIR, BIAS_POS, HAS_CAP)
        if (kind >= 0) | ((kt + 1) * BN > Nk):
            ok = _allowed(kind, b, th, offs_m, offs_n, Nq, Nk, band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID,
                          s_kid, PREFIX, s_prefix, TILES, s_tile, s_tile_h, MASK_KIND, HAS_BAND,
                          HAS_KVLEN, HAS_DOC, HAS_PREFIX, BM, BN)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROP:
            keep = _keep(seed, threshold, b, h, Hq, offs_m, offs_n, Nq, Nk)
            p = tl.where(keep, p * keep_scale, 0.0)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * sv_n + offs_dv[None, :],
                    mask=(offs_n < Nk)[:, None] & (offs_dv < DV)[None, :], other=0.0)  # [BN, BDV]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptr = O + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
    tl.store(o_ptr + offs_m[:, None].to(tl.int64) * so_n + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=(offs_m < Nq)[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)


@triton.jit
def _tile_grads(q, k, v, do, lse, delta, b, h, Hq, offs_m, offs_n, kind, kt, Nq, Nk, scale,
                band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX, s_prefix, TILES, s_tile, s_tile_h,
                th, SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap, seed, threshold, keep_scale,
                MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                HAS_PREFIX: tl.constexpr, ALIBI_POS: tl.constexpr, ALIBI_BIDIR: tl.constexpr,
                BIAS_POS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_DROP: tl.constexpr, PREC: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    """Recomputed P (dropped, for dV) and dS (w.r.t. the final score) and dS w.r.t. the raw score,
    for one [BM, BN] tile. q [BM, BD], k [BD, BN], v [BDV, BN], do [BM, BDV]."""
    s = _dot(q, k, PREC) * scale
    s, t = _modify(s, b, h, offs_m, offs_n, Nq, Nk, SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap,
                   ALIBI_POS, ALIBI_BIDIR, BIAS_POS, HAS_CAP)
    if (kind >= 0) | ((kt + 1) * BN > Nk):  # rows past Nq have lse = +inf: P = 0 there
        ok = _allowed(kind, b, th, offs_m, offs_n, Nq, Nk, band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid,
                      PREFIX, s_prefix, TILES, s_tile, s_tile_h, MASK_KIND, HAS_BAND, HAS_KVLEN,
                      HAS_DOC, HAS_PREFIX, BM, BN)
        s = tl.where(ok, s, float("-inf"))
    p = tl.exp(s - lse[:, None])  # lse = +inf on empty rows: P = 0
    dp = _dot(do, v, PREC)  # [BM, BN]
    pd = p
    if HAS_DROP:
        keep = _keep(seed, threshold, b, h, Hq, offs_m, offs_n, Nq, Nk)
        pd = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])  # w.r.t. the final score
    ds_raw = ds
    if HAS_CAP:
        ds_raw = ds * (1.0 - t * t)
    return pd, ds, ds_raw


@triton.jit(do_not_specialize=["seed", "threshold", "Nq", "Nk"])
def attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, DBIAS, DSLOPE,
                sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdo_b, sdo_h, sdo_n,
                Hq, G, Nq, Nk, D, DV, scale, TQ,
                NUM, IDX, KIND, s_lb, s_lt, TK_L,
                band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX, s_prefix, TILES, s_tile, s_tile_h,
                SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap, seed, threshold, keep_scale,
                MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                HAS_PREFIX: tl.constexpr, TILE_HEADS: tl.constexpr,
                ALIBI_POS: tl.constexpr, ALIBI_BIDIR: tl.constexpr, BIAS_POS: tl.constexpr, HAS_CAP: tl.constexpr,
                HAS_DROP: tl.constexpr, PREC: tl.constexpr, BIAS_GRAD: tl.constexpr, SLOPE_GRAD: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """dQ of one query tile; also dS into DBIAS (B, Hq, Nq, Nk) and per-program ALiBi slope sums."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G
    th = h if TILE_HEADS else 0
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    mrow = offs_m < Nq
    q = tl.load(Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + offs_m[:, None].to(tl.int64) * sq_n
                + offs_d[None, :], mask=mrow[:, None] & (offs_d < D)[None, :], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h + offs_m[:, None].to(tl.int64) * sdo_n
                 + offs_dv[None, :], mask=mrow[:, None] & (offs_dv < DV)[None, :], other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * Nq + offs_m, mask=mrow, other=float("inf"))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * Nq + offs_m, mask=mrow, other=0.0)
    k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
    dq = tl.zeros([BM, BD], tl.float32)
    slope_acc = tl.zeros([BM, BN], tl.float32)
    row = b * s_lb + pid_m * s_lt
    n_tiles = tl.load(NUM + row)
    for i in range(0, n_tiles):
        kt = tl.load(IDX + row * TK_L + i)
        kind = tl.load(KIND + row * TK_L + i)
        offs_n = kt * BN + tl.arange(0, BN)
        ncol = offs_n < Nk
        k = tl.load(k_base + offs_n[None, :].to(tl.int64) * sk_n + offs_d[:, None],
                    mask=ncol[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, BN]
        vt = tl.load(v_base + offs_n[None, :].to(tl.int64) * sv_n + offs_dv[:, None],
                     mask=ncol[None, :] & (offs_dv < DV)[:, None], other=0.0)  # [BDV, BN]
        pd, ds, ds_raw = _tile_grads(q, k, vt, do, lse, delta, b, h, Hq, offs_m, offs_n, kind, kt, Nq, Nk, scale,
                                     band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX, s_prefix,
                                     TILES, s_tile, s_tile_h, th, SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap,
                                     seed, threshold, keep_scale, MASK_KIND, HAS_BAND, HAS_KVLEN, HAS_DOC,
                                     HAS_PREFIX, ALIBI_POS, ALIBI_BIDIR, BIAS_POS, HAS_CAP, HAS_DROP, PREC, BM, BN)
        dq += _dot(ds_raw.to(k.dtype), tl.trans(k), PREC)
        if BIAS_GRAD:
            g = ds_raw if BIAS_POS == 1 else ds
            ptr = DBIAS + pid_bh.to(tl.int64) * Nq * Nk + offs_m[:, None].to(tl.int64) * Nk + offs_n[None, :]
            tl.store(ptr, g, mask=mrow[:, None] & ncol[None, :])
        if SLOPE_GRAD:
            g = ds_raw if ALIBI_POS == 1 else ds
            dist = ((offs_m + (Nk - Nq))[:, None] - offs_n[None, :]).to(tl.float32)
            if ALIBI_BIDIR:
                dist = tl.abs(dist)
            slope_acc += tl.where(mrow[:, None] & ncol[None, :], -g * dist, 0.0)
    tl.store(DQ + pid_bh.to(tl.int64) * Nq * D + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], dq * scale,
             mask=mrow[:, None] & (offs_d < D)[None, :])
    if SLOPE_GRAD:
        tl.store(DSLOPE + pid_bh.to(tl.int64) * TQ + pid_m, tl.sum(tl.sum(slope_acc, 1), 0))


@triton.jit(do_not_specialize=["seed", "threshold", "Nq", "Nk"])
def attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV_OUT,
                  sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdo_b, sdo_h, sdo_n,
                  Hq, Hkv, G, Nq, Nk, D, DV, scale,
                  NUM, IDX, KIND, s_lb, s_lt, TQ_L,
                  band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX, s_prefix, TILES, s_tile, s_tile_h,
                  SLOPES, s_slope, BIAS, sb_b, sb_h, sb_q, sb_k, cap, seed, threshold, keep_scale,
                  MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                  HAS_PREFIX: tl.constexpr, TILE_HEADS: tl.constexpr,
                  ALIBI_POS: tl.constexpr, ALIBI_BIDIR: tl.constexpr, BIAS_POS: tl.constexpr, HAS_CAP: tl.constexpr,
                  HAS_DROP: tl.constexpr, PREC: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """dK, dV of one key tile of one kv head, summed over its G query heads (GQA without repeats)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    ncol = offs_n < Nk
    k = tl.load(K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h + offs_n[None, :].to(tl.int64) * sk_n
                + offs_d[:, None], mask=ncol[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, BN]
    vt = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[None, :].to(tl.int64) * sv_n
                 + offs_dv[:, None], mask=ncol[None, :] & (offs_dv < DV)[:, None], other=0.0)  # [BDV, BN]
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    row = b * s_lb + pid_n * s_lt
    n_tiles = tl.load(NUM + row)
    for g in range(0, G):
        h = hk * G + g
        th = h if TILE_HEADS else 0
        bh = b * Hq + h
        q_base = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        do_base = DO + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
        for i in range(0, n_tiles):
            qt = tl.load(IDX + row * TQ_L + i)
            kind = tl.load(KIND + row * TQ_L + i)
            offs_m = qt * BM + tl.arange(0, BM)
            mrow = offs_m < Nq
            q = tl.load(q_base + offs_m[:, None].to(tl.int64) * sq_n + offs_d[None, :],
                        mask=mrow[:, None] & (offs_d < D)[None, :], other=0.0)
            do = tl.load(do_base + offs_m[:, None].to(tl.int64) * sdo_n + offs_dv[None, :],
                         mask=mrow[:, None] & (offs_dv < DV)[None, :], other=0.0)
            lse = tl.load(LSE + bh.to(tl.int64) * Nq + offs_m, mask=mrow, other=float("inf"))
            delta = tl.load(DELTA + bh.to(tl.int64) * Nq + offs_m, mask=mrow, other=0.0)
            pd, ds, ds_raw = _tile_grads(q, k, vt, do, lse, delta, b, h, Hq, offs_m, offs_n, kind, pid_n, Nq, Nk,
                                         scale, band_lo, band_hi, KVLEN, s_kvlen, QID, s_qid, KID, s_kid, PREFIX,
                                         s_prefix, TILES, s_tile, s_tile_h, th, SLOPES, s_slope, BIAS, sb_b, sb_h,
                                         sb_q, sb_k, cap, seed, threshold, keep_scale, MASK_KIND, HAS_BAND,
                                         HAS_KVLEN, HAS_DOC, HAS_PREFIX, ALIBI_POS, ALIBI_BIDIR, BIAS_POS, HAS_CAP,
                                         HAS_DROP, PREC, BM, BN)
            dv += _dot(tl.trans(pd.to(do.dtype)), do, PREC)
            dk += _dot(tl.trans(ds_raw.to(q.dtype)), q, PREC)
    out = pid_bh.to(tl.int64) * Nk
    tl.store(DK + (out + offs_n[:, None]) * D + offs_d[None, :], dk * scale, mask=ncol[:, None] & (offs_d < D)[None, :])
    tl.store(DV_OUT + (out + offs_n[:, None]) * DV + offs_dv[None, :], dv,
             mask=ncol[:, None] & (offs_dv < DV)[None, :])
