"""qkv's compiled CPU kernels: C++ (``csrc/``) built once per machine with torch's extension builder.

Some CPU work cannot be written fast as torch ops: attention over keys that each query row lists (``masks.topk``)
must gather 2 MB of keys and values per row at DeepSeek-V3.2's K = 2,048, and as torch ops the gathered copy goes
out to memory and is read back by the product; the chunked gated delta rule as batched torch ops sweeps every chunk
through memory once per step of its algebra. :mod:`qkv.cpu.csrc` holds kernels that read such keys in place and work
a chunk at a time in cache instead. Other work is fast as torch ops but so small and so frequent that Python's
dispatch dominates it: a decode step's few-row products and one token's experts (``products.cpp``) run the same
ATen calls in the same order from C++. Elementwise work that torch runs as several passes through memory is one
pass: rotary embeddings (``rotary.cpp``) and SwiGLU's gate (``activations.cpp``), each with torch's values bit for
bit, and RMSNorm (``norms.cpp``), one loop per row. A decode step's attention reads the cache in place, a paged
cache's blocks or a contiguous cache as one block a row (``paged_decode.cpp``, ``decode_attention.cpp``), with no
mask, list or padded view built; so does a prompt chunk's over a paged cache (``paged_prefill.cpp``, the score and
value products by oneDNN's batch-reduce GEMM through torch), and a step's keys and values go into their blocks in
one call (``paged_store.cpp``). Greedy tokens of an LM head come from an int8 screen and a float64 check of the
few tokens it leaves (``greedy_head.cpp``, :mod:`qkv.cpu.greedy`). ``module.cpp`` binds one
function per kernel file and is the only one that includes pybind's headers (the kernels include ATen alone, which
halves a cold build); ``blas.h`` declares the BLAS they call. This module builds them on first use
(``torch.utils.cpp_extension.load``: the C++ compiler and ``ninja``, under a minute on 2 cores, then cached under
torch's extensions folder) for the vector width torch itself uses on this CPU (AVX-512, AVX2 or plain), with OpenMP,
so that ``at::parallel_for`` in them spreads over torch's threads (the process's one OpenMP runtime, torch's own).

Nothing here is a silent fallback. Where the kernels cannot be had (no compiler, a torch without the BLAS symbols
they link, or ``QKV_CPU_KERNELS=0`` in the environment), :func:`unavailable_reason` says why, the backends that
would use them take their torch-op path, and ``qkv.explain`` reports which path ran and why.

Example:
    >>> from qkv.cpu import kernels
    >>> kernels.unavailable_reason() is None or isinstance(kernels.unavailable_reason(), str)
    True
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["load", "unavailable_reason", "tile_keys", "profiled", "ENV", "TILE_BYTES"]

#: Set to ``0`` to keep qkv from building or using its compiled CPU kernels (the torch-op paths run instead).
ENV = "QKV_CPU_KERNELS"

#: Bytes of keys per tile of the gather kernel: 256 keys of 128 float32 channels are 128 KB of keys and as much of
#: values, which stay in a 1 MB L2 while a tile is multiplied (128-512 keys measured within 5% at N = 32K).
TILE_BYTES = 128 << 10

_SOURCES = ("module.cpp", "gather_attention.cpp", "gated_delta.cpp", "delta_decode.cpp", "products.cpp",
            "rotary.cpp", "norms.cpp", "decode_attention.cpp", "paged_decode.cpp",
            "paged_prefill.cpp", "paged_store.cpp", "activations.cpp", "greedy_head.cpp")
_FLAGS = {  # torch's own CPU capability names -> the flags that give ATen's vector types that width
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
_lock = threading.Lock()
_module = None
_failure: str | None = None


def _capability() -> str:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch: plain code
        return "DEFAULT"
    if cap.startswith("AVX512"):
        return "AVX512"
    return cap if cap in _FLAGS else "DEFAULT"


def _build():
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` package installs its binary beside this interpreter
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
    cap = _capability()
    src = Path(__file__).with_name("csrc")
    # no fused multiply-adds but the kernels' own: kernels that redo torch's arithmetic (rotary, SwiGLU's gate)
    # give its values bit for bit only when a * b + c rounds twice, as torch's separate ops do
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", *_FLAGS.get(cap, [])]
    return cpp_extension.load(name=f"qkv_cpu_kernels_{cap.lower()}", sources=[str(src / s) for s in _SOURCES],
                              extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def _switched_off() -> bool:
    """``QKV_CPU_KERNELS=0`` in the environment, read on every call (tests and users may set it at any time).
    A decode step asks some thirty times, so on POSIX the environment's own dict is read (``os.environ.get``
    costs microseconds: it encodes the key and goes through the mapping protocol)."""
    data = getattr(os.environ, "_data", None)
    if type(data) is dict and os.name == "posix":
        return data.get(_ENV_KEY) == b"0"
    return os.environ.get(ENV, "1") == "0"


_ENV_KEY = ENV.encode()


def load():
    """The compiled kernels module (built on first call), or ``None`` where :func:`unavailable_reason` says why."""
    global _module, _failure
    if _switched_off():
        return None
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as e:  # noqa: BLE001 - any build or import failure: say it once, use the torch paths
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _failure = (f"building qkv's CPU kernels failed ({type(e).__name__}: {first}); they need a C++ "
                            f"compiler and ninja (pip install ninja)")
                warnings.warn(f"{_failure}; the torch-op paths run instead", RuntimeWarning, stacklevel=2)
    return _module


def profiled(name: str, fn, *args):
    """``fn(*args)``, inside a profiler range ``qkv::<name>`` while torch's profiler records. A kernel that makes
    no ATen call (its own loops) is otherwise invisible to the profiler, and its time would be counted as
    Python's; outside a profile this costs one attribute read, not a range (about 6 us)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):  # torch's own flag, set while recording
        with torch.profiler.record_function(f"qkv::{name}"):
            return fn(*args)
    return fn(*args)


def tile_keys(element_size: int, dim: int) -> int:
    """Keys per tile of the gather kernel for keys of ``dim`` channels of ``element_size`` bytes (at least 16)."""
    return max(16, TILE_BYTES // (element_size * max(dim, 1)))


def unavailable_reason() -> str | None:
    """Why the compiled kernels cannot run here, or ``None`` when they can (builds them if not yet built)."""
    if _switched_off():
        return f"{ENV}=0 in the environment"
    load()
    return _failure
