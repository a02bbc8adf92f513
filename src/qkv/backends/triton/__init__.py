"""The Triton backend: qkv's own GPU kernels behind the operator contract.

Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (forward
and backward); Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (paged decode); DeepSeek-AI 2024, "DeepSeek-V2" (MLA, absorbed decode).

What it honours: every ``qkv.masks`` mask (EMPTY tiles skipped from the mask's block map, FULL tiles
without mask arithmetic, PARTIAL tiles masked in the kernel: analytically for causal, windows,
padding, documents and prefix-LM, from dense per-tile maps otherwise), GQA/MQA without repeating K/V,
``Dv != Dqk``, ALiBi, softcap, tensor and relative bias (with gradients), the log-sum-exp, seeded
dropout with the same keep pattern as every other backend, float16/bfloat16/float32 with float32
accumulation, head dims up to 256. Forward and backward. Learnable ``sinks=``: the kernels have no sink
term; ``qkv.attention`` merges the sinks into their output and log-sum-exp (``qkv._sinks``), and the
gradient of that lse runs through the kernels' backward. ``layout="bnhd"`` reaches the kernels as strided
views. Declined, with the reason: a Python ``mods.from_fn``, and two modifiers of one kind in a chain
(two ALiBi, two softcaps, two tensor/relative biases).

Where it runs: CUDA tensors with ``triton`` installed (``pip install 'qkv[gpu]'``), or CPU tensors under
``TRITON_INTERPRET=1`` (Triton's interpreter: slow, for tests). Otherwise it declines with the reason,
and ``qkv.explain`` shows it. ``auto`` considers it on CUDA only.

The decode kernels (:func:`paged_decode`, :func:`mla_decode`) live in ``decode.py``.

Example:
    >>> import torch, qkv
    >>> x = torch.randn(1, 2, 8, 16)
    >>> "triton" in qkv.explain(x, x, x).declined or torch.cuda.is_available()
    True
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os

import torch

from ..._request import AttentionOutput, Request
from ..base import NOMINAL_FLOPS, Backend, Estimate

__all__ = ["TritonBackend", "triton_problem", "gpu_decode_ready", "MAX_HEAD_DIM"]

#: Largest head dim (Dqk and Dv) the kernels take.
MAX_HEAD_DIM = 256
_DTYPES = ("float16", "bfloat16", "float32")
#: Fraction of the nominal GPU rate the kernels reach (below SDPA-flash's, so a dense problem goes to SDPA).
_RATE_FACTOR = 0.9
_PARTIAL_TILE_COST = 1.3
_LAUNCH_S = 2e-5


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET=1``) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_problem(device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` here; None when they can."""
    if not _installed():
        return "triton is not installed; install it with pip install 'qkv[gpu]' (CUDA GPUs)"
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        return None
    if kind == "cpu":
        if interpreting():
            return None
        return ("CPU tensors: the Triton kernels need a CUDA GPU (set TRITON_INTERPRET=1 before triton is imported "
                "to run them in Triton's slow interpreter, for testing)")
    return f"device {kind}: the Triton kernels run on CUDA (or CPU under TRITON_INTERPRET=1)"


def gpu_decode_ready(*tensors) -> bool:
    """True when the decode kernels should serve these tensors: all on CUDA in float16/bfloat16/float32,
    none needing gradients (the decode kernels are inference only), and triton installed. The cache and
    MLA code call this before taking the Triton path, and keep their own path otherwise."""
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    if any(str(t.dtype).replace("torch.", "") not in _DTYPES for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return triton_problem(tensors[0].device) is None


def kernels(name: str):
    """The kernel module ``name`` ('attention' or 'decode'), imported on first use (imports triton)."""
    return importlib.import_module(f"{__name__}.{name}")


class TritonBackend(Backend):
    """qkv's Triton kernels: tiled forward/backward with block-sparse skipping and score modifiers."""

    name = "triton"

    def decline(self, req: Request) -> str | None:
        problem = triton_problem(req.device)
        if problem is not None:
            return problem
        dtype = str(req.dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            return f"dtype {dtype}: the Triton kernels take float16, bfloat16 and float32; use backend='reference'"
        if not 0 < min(req.Dqk, req.Dv) <= max(req.Dqk, req.Dv) <= MAX_HEAD_DIM:
            return f"head dims Dqk={req.Dqk}, Dv={req.Dv}: the Triton kernels take 1..{MAX_HEAD_DIM}"
        from ._lower import lower_mods

        mods = lower_mods(req.score_mod)
        return mods if isinstance(mods, str) else None

    def estimate(self, req: Request) -> Estimate:
        if req.device.type != "cuda":
            return Estimate(1e9, "Triton's interpreter on CPU: for testing, never chosen by auto")
        if req.Nq == 0 or req.Nk == 0:
            return Estimate(_LAUNCH_S, "empty problem")
        from ._lower import lower_mask
        from .attention import tile_sizes

        t = tile_sizes(req.Dqk, req.Dv, req.device, req.dtype)
        plan = lower_mask(req.mask, req.B, req.Hq, req.Nq, req.Nk, t.bm, t.bn, req.device)
        per_row = req.B / plan.Bm
        tile_flops = 2.0 * req.Hq * t.bm * t.bn * (req.Dqk + req.Dv)
        work = (plan.visited - plan.partial + _PARTIAL_TILE_COST * plan.partial) * per_row * tile_flops
        seconds = work / (NOMINAL_FLOPS["cuda"] * _RATE_FACTOR) + _LAUNCH_S
        grid = math.ceil(req.Nq / t.bm) * math.ceil(req.Nk / t.bn) * plan.Bm
        return Estimate(seconds, f"{plan.visited}/{grid} tiles of {t.bm}x{t.bn} ({plan.partial} partial)")

    def run(self, req: Request) -> AttentionOutput:
        return kernels("attention").run(req)
