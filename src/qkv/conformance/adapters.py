"""Adapters: wrap an attention kernel into the plain form the battery calls (:mod:`qkv.plain`).

An adapter changes only the calling convention: qkv's (B, H, N, D) tensors go in, the kernel's own layout
and keywords are built from them, and its output comes back as (B, H, N, D). Conventions the battery checks
are passed through untouched: the log-sum-exp is returned exactly as the kernel gives it (its base and
layout are what the battery probes), causal is the kernel's own causal flag, a fully masked row is whatever
the kernel returns.

Runnable here: :func:`sdpa`, :func:`flex`, :func:`hf_eager`, :func:`hf_sdpa`, :func:`qkv_backend`.
Written against the documented signatures and import-guarded (they take the kernel function as an argument,
so tests can pass a fake that follows the signature): :func:`varlen_attn` (``torch.nn.attention.varlen``,
CUDA only), :func:`flash_attn` (FlashAttention 2 ``flash_attn_func``, 3 ``flash_attn_interface.flash_attn_func``
and 4 ``flash_attn.cute.flash_attn_func``), :func:`flash_attn_varlen` (``flash_attn_varlen_func``),
:func:`flashinfer_single_prefill` (``single_prefill_with_kv_cache``) and :func:`flashinfer_ragged`
(``BatchPrefillWithRaggedKVCacheWrapper``).

Example:
    >>> import torch
    >>> from qkv.conformance import adapters
    >>> fn = adapters.qkv_backend("tiled")
    >>> fn(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), causal=True).shape
    torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace

import torch

__all__ = ["ADAPTERS", "by_name", "sdpa", "flex", "hf_eager", "hf_sdpa", "qkv_backend", "varlen_attn", "flash_attn",
           "flash_attn_varlen", "flashinfer_single_prefill", "flashinfer_ragged"]


def qkv_backend(name: str, *, batch_invariant: bool = False) -> Callable:
    """``qkv.attention(..., backend=name)``: causal is ``masks.causal()`` (bottom-right), window is
    ``masks.sliding_window(left, right)``, softcap is ``mods.softcap``."""
    from .. import masks, mods
    from .._attention import attention

    def fn(q, k, v, *, causal=False, window=None, sinks=None, softcap=None, scale=None, return_lse=False):
        mask = masks.causal() if causal else None
        if window is not None:
            w = masks.sliding_window(*window)
            mask = w if mask is None else mask & w
        return attention(q, k, v, mask=mask, score_mod=None if softcap is None else mods.softcap(softcap),
                         sinks=sinks, scale=scale, return_lse=return_lse, backend=name,
                         batch_invariant=batch_invariant)
    fn.__name__ = f"qkv_{name}"
    return fn


def sdpa() -> Callable:
    """``torch.nn.functional.scaled_dot_product_attention`` with its own ``is_causal`` and ``enable_gqa``."""
    F = torch.nn.functional

    def fn(q, k, v, *, causal=False, scale=None):
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    return fn


_FLEX: dict[str, Callable] = {}


def flex() -> Callable:
    """FlexAttention (compiled; on CPU too). Causal is the mask_mod ``q_idx >= kv_idx`` as commonly written,
    window is ``(q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)``, softcap is a score_mod; the lse comes
    from ``return_aux=AuxRequest(lse=True)``."""
    from torch.nn.attention import flex_attention as fa

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(fa.flex_attention, dynamic=False)

    def fn(q, k, v, *, causal=False, window=None, softcap=None, scale=None, return_lse=False):
        if k.shape[2] == 0 and q.device.type == "cpu":
            raise RuntimeError("not run: FlexAttention's compiled CPU kernel kills the process (SIGFPE) on an "
                               "empty key set in torch " + torch.__version__)
        mask_mod = None
        if causal or window is not None:
            def mask_mod(b, h, q_idx, kv_idx):
                ok = q_idx >= kv_idx if causal else q_idx == q_idx
                if window is not None:
                    ok = ok & (q_idx - kv_idx <= window[0]) & (kv_idx - q_idx <= window[1])
                return ok
        block_mask = (None if mask_mod is None else
                      fa.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device))
        score_mod = None
        if softcap is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)
        kw = {"return_aux": fa.AuxRequest(lse=True)} if return_lse else {}
        # the battery compiles one kernel per shape and option set, more than dynamo's default recompile limit
        # (past it, flex_attention silently runs its unfused eager fallback, which is not the kernel under test)
        with torch._dynamo.config.patch(recompile_limit=256):
            res = _FLEX["fn"](q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1], **kw)
        if return_lse:
            out, aux = res
            return out, aux.lse
        return res
    return fn


def _hf_module(q, k, causal: bool):
    return SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, is_causal=causal,
                           config=SimpleNamespace())


def _hf_mask(q, k, causal, window):
    """HF's additive float mask (B, 1, Nq, Nk), bottom-right as its models build it (queries are the last
    positions), with ``finfo.min`` for masked pairs."""
    if not causal and window is None:
        return None
    nq, nk = q.shape[2], k.shape[2]
    p = torch.arange(nq, device=q.device).view(-1, 1) + (nk - nq)
    j = torch.arange(nk, device=q.device).view(1, -1)
    ok = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        ok &= j <= p
    if window is not None:
        ok &= (j >= p - window[0]) & (j <= p + window[1])
    mask = torch.zeros(nq, nk, dtype=q.dtype, device=q.device).masked_fill(~ok, torch.finfo(q.dtype).min)
    return mask.view(1, 1, nq, nk).expand(q.shape[0], 1, nq, nk)


def hf_eager() -> Callable:
    """transformers' ``eager_attention_forward`` (Llama's; the one most model files copy) with the additive
    mask HF's models build."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def fn(q, k, v, *, causal=False, window=None, scale=None):
        out, _ = eager_attention_forward(_hf_module(q, k, causal), q, k, v, _hf_mask(q, k, causal, window),
                                         scaling=q.shape[-1] ** -0.5 if scale is None else scale, dropout=0.0)
        return out.transpose(1, 2)  # HF returns (B, N, H, D)
    return fn


def hf_sdpa() -> Callable:
    """transformers' ``ALL_ATTENTION_FUNCTIONS["sdpa"]``. With ``causal`` and no window it passes no mask
    and lets the function apply its own ``is_causal`` (what HF's models do when the mask can be skipped);
    with a window it passes HF's additive mask."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def fn(q, k, v, *, causal=False, window=None, scale=None):
        mask = _hf_mask(q, k, causal, window) if window is not None else None
        out, _ = impl(_hf_module(q, k, causal), q, k, v, mask, dropout=0.0,
                      scaling=q.shape[-1] ** -0.5 if scale is None else scale, is_causal=causal and mask is None)
        return out.transpose(1, 2)
    return fn


def _pack(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B * N, H, D), the varlen layout."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _unpack(x: torch.Tensor, B: int, N: int) -> torch.Tensor:
    """(B * N, H, D) -> (B, H, N, D)."""
    return x.reshape(B, N, x.shape[1], x.shape[2]).transpose(1, 2)


def _cu(B: int, N: int, device) -> torch.Tensor:
    return torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=device)


def _import(module: str, name: str, what: str):
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ImportError(f"{what} needs {module!r} ({e}); install it, or pass the kernel function itself") from None


def varlen_attn(kernel: Callable | None = None) -> Callable:
    """``torch.nn.attention.varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
    return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False)`` (CUDA only in torch 2.13).
    Causal is ``window_size=(-1, 0)``; the lse comes back as the kernel gives it."""
    if kernel is None:
        kernel = _import("torch.nn.attention.varlen", "varlen_attn", "varlen_attn")

    def fn(q, k, v, *, causal=False, window=None, scale=None, return_lse=False):
        B, nq, nk = q.shape[0], q.shape[2], k.shape[2]
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0
        kw = {}
        if return_lse:
            from torch.nn.attention.varlen import AuxRequest
            kw["return_aux"] = AuxRequest(lse=True)
        res = kernel(_pack(q), _pack(k), _pack(v), _cu(B, nq, q.device), _cu(B, nk, q.device), nq, nk, scale=scale,
                     window_size=(left, right), enable_gqa=q.shape[1] != k.shape[1], **kw)
        if return_lse:
            out, lse = res
            return _unpack(out, B, nq), lse
        return _unpack(res, B, nq)
    return fn


def flash_attn(kernel: Callable | None = None, *, version: int = 2) -> Callable:
    """FlashAttention's ``flash_attn_func`` on (B, N, H, D) tensors: version 2 (``flash_attn``: ``softmax_scale,
    causal, window_size=(-1, -1), softcap=0.0, return_attn_probs`` gives ``(out, lse, S)``), 3
    (``flash_attn_interface``: returns ``(out, lse)`` with ``return_attn_probs``) or 4 (``flash_attn.cute``:
    ``window_size=(None, None)``, ``learnable_sink``, returns ``(out, lse)``)."""
    if version not in (2, 3, 4):
        raise ValueError(f"flash_attn: version must be 2, 3 or 4, got {version!r}")
    if kernel is None:
        module = {2: "flash_attn", 3: "flash_attn_interface", 4: "flash_attn.cute"}[version]
        kernel = _import(module, "flash_attn_func", f"FlashAttention {version}")

    def _call(q, k, v, causal, window, softcap, scale, sinks, return_lse):
        t = [x.transpose(1, 2) for x in (q, k, v)]
        kw = {"softmax_scale": scale, "causal": causal, "softcap": 0.0 if softcap is None else softcap}
        if version == 4:
            kw["window_size"] = (None, None) if window is None else tuple(window)
            if sinks is not None:
                kw["learnable_sink"] = sinks
        else:
            kw["window_size"] = (-1, -1) if window is None else tuple(window)
            if return_lse:
                kw["return_attn_probs"] = True
        res = kernel(*t, **kw)
        out, lse = (res[0], res[1]) if isinstance(res, (tuple, list)) else (res, None)
        out = out.transpose(1, 2)
        return (out, lse) if return_lse else out

    if version == 4:
        def fn(q, k, v, *, causal=False, window=None, sinks=None, softcap=None, scale=None, return_lse=False):
            return _call(q, k, v, causal, window, softcap, scale, sinks, return_lse)
    else:
        def fn(q, k, v, *, causal=False, window=None, softcap=None, scale=None, return_lse=False):
            return _call(q, k, v, causal, window, softcap, scale, None, return_lse)
    return fn


def flash_attn_varlen(kernel: Callable | None = None) -> Callable:
    """FlashAttention 2's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, ..., return_attn_probs)`` on packed
    (total, H, D) tensors; its lse is (H, total)."""
    if kernel is None:
        kernel = _import("flash_attn", "flash_attn_varlen_func", "FlashAttention 2 varlen")

    def fn(q, k, v, *, causal=False, window=None, softcap=None, scale=None, return_lse=False):
        B, nq, nk = q.shape[0], q.shape[2], k.shape[2]
        res = kernel(_pack(q), _pack(k), _pack(v), _cu(B, nq, q.device), _cu(B, nk, q.device), nq, nk,
                     dropout_p=0.0, softmax_scale=scale, causal=causal,
                     window_size=(-1, -1) if window is None else tuple(window),
                     softcap=0.0 if softcap is None else softcap, return_attn_probs=return_lse)
        if return_lse:
            return _unpack(res[0], B, nq), res[1]
        return _unpack(res, B, nq)
    return fn


def flashinfer_single_prefill(kernel: Callable | None = None) -> Callable:
    """FlashInfer's ``single_prefill_with_kv_cache(q, k, v, causal=, kv_layout="NHD", sm_scale=, window_left=,
    logits_soft_cap=, return_lse=)`` for one request at a time: q (Nq, H, D), lse (Nq, H). Batch rows are run
    one by one and their lse stacked (so a (B, Nq, H) lse is the kernel's token-major layout)."""
    if kernel is None:
        kernel = _import("flashinfer", "single_prefill_with_kv_cache", "FlashInfer")

    def fn(q, k, v, *, causal=False, window=None, softcap=None, scale=None, return_lse=False):
        if window is not None and window[1] != 0:
            raise ValueError("FlashInfer's window_left has no right extent; window right must be 0")
        outs, lses = [], []
        for b in range(q.shape[0]):
            res = kernel(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), causal=causal,
                         kv_layout="NHD", sm_scale=scale, window_left=-1 if window is None else window[0],
                         logits_soft_cap=softcap, return_lse=return_lse)
            out, lse = (res[0], res[1]) if return_lse else (res, None)
            outs.append(out.transpose(0, 1))
            lses.append(lse)
        out = torch.stack(outs)
        return (out, torch.stack(lses)) if return_lse else out
    return fn


def flashinfer_ragged(wrapper_cls: type | None = None, *, workspace_bytes: int = 128 << 20) -> Callable:
    """FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")``: ``plan(qo_indptr, kv_indptr,
    num_qo_heads, num_kv_heads, head_dim_qk, causal=, sm_scale=, window_left=, logits_soft_cap=)`` then
    ``run(q, k, v, return_lse=)`` on packed (total, H, D); its lse is (total, H)."""
    if wrapper_cls is None:
        wrapper_cls = _import("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper", "FlashInfer")

    def fn(q, k, v, *, causal=False, window=None, softcap=None, scale=None, return_lse=False):
        if window is not None and window[1] != 0:
            raise ValueError("FlashInfer's window_left has no right extent; window right must be 0")
        B, nq, nk = q.shape[0], q.shape[2], k.shape[2]
        wrapper = wrapper_cls(torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device), "NHD")
        wrapper.plan(_cu(B, nq, q.device), _cu(B, nk, q.device), q.shape[1], k.shape[1], q.shape[3], causal=causal,
                     sm_scale=scale, window_left=-1 if window is None else window[0], logits_soft_cap=softcap)
        res = wrapper.run(_pack(q), _pack(k), _pack(v), return_lse=return_lse)
        if return_lse:
            return _unpack(res[0], B, nq), res[1]
        return _unpack(res, B, nq)
    return fn


def _qkv(name: str) -> Callable[[], Callable]:
    return lambda: qkv_backend(name)


#: The names ``qkv conform`` takes, each a factory of a plain function.
ADAPTERS: dict[str, Callable[[], Callable]] = {
    "sdpa": sdpa, "flex": flex, "hf-eager": hf_eager, "hf-sdpa": hf_sdpa,
    "reference": _qkv("reference"), "tiled": _qkv("tiled"), "qkv-sdpa": _qkv("sdpa"), "qkv-flex": _qkv("flex"),
    "triton": _qkv("triton"), "tiled-invariant": lambda: qkv_backend("tiled", batch_invariant=True),
    "varlen": varlen_attn, "fa2": lambda: flash_attn(version=2), "fa3": lambda: flash_attn(version=3),
    "fa4": lambda: flash_attn(version=4), "fa2-varlen": flash_attn_varlen,
    "flashinfer": flashinfer_single_prefill, "flashinfer-ragged": flashinfer_ragged,
}


def by_name(name: str) -> Callable:
    """The plain function for an adapter name in :data:`ADAPTERS`."""
    if name not in ADAPTERS:
        raise ValueError(f"unknown adapter {name!r}; valid names: {', '.join(ADAPTERS)}")
    return ADAPTERS[name]()
