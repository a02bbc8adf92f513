"""qkv's compiled CPU kernels (C++ in ``csrc/``) as torch operators, ``torch.ops.qkv_cpu.<name>``: found prebuilt in
the installed package, or built once per machine with torch's extension builder.

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
few tokens it leaves (``greedy_head.cpp``, :mod:`qkv.cpu.greedy`). ``module.cpp`` declares every operator's schema
once (``TORCH_LIBRARY(qkv_cpu, ...)``) and refuses inputs that require a gradient; ``blas.h`` declares the BLAS
they call. Code outside :mod:`qkv.cpu` reaches them through :mod:`qkv.cpu.ops` only.

Where the library comes from, in order:

1. **prebuilt**: a wheel (``pip wheel .``, ``make wheel``) carries one library per CPU capability in
   ``qkv/cpu/_lib/`` (``DEFAULT``, ``AVX2``, ``AVX512``, as ATen's ``CPU_CAPABILITY``: vector widths ATen's own
   kernels use), each built against one torch version. The best one this CPU runs
   (``torch.backends.cpu.get_cpu_capability()``) is loaded with ``torch.ops.load_library`` when the running torch is
   the one it was built against; otherwise a warning says so and step 2 runs.
2. **JIT**: ``torch.utils.cpp_extension.load`` (a C++ compiler and ``ninja``) builds them for this CPU's capability
   under torch's extensions folder, once: a warning says beforehand what it builds, why and about how long.

Nothing here is a silent fallback. Where the kernels cannot be had (no compiler, a torch without the BLAS symbols
they link, or ``QKV_CPU_KERNELS=0`` in the environment), :func:`unavailable_reason` says why, the callers take
their torch-op path, and ``qkv.explain`` and ``qkv doctor`` report which path ran and why.

Example:
    >>> from qkv.cpu import kernels
    >>> kernels.unavailable_reason() is None or isinstance(kernels.unavailable_reason(), str)
    True
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from . import fakes
from .build import BASE_FLAGS, CAPABILITIES, CAPABILITIES_ENV, FLAGS, SOURCES, library_name

__all__ = ["load", "unavailable_reason", "status", "Status", "tile_keys", "profiled", "capability", "ENV",
           "CAPABILITIES_ENV", "CAPABILITIES", "SOURCES", "FLAGS", "TILE_BYTES", "PREBUILT_DIR", "library_name"]

#: Set to ``0`` to keep qkv from building or using its compiled CPU kernels (the torch-op paths run instead).
ENV = "QKV_CPU_KERNELS"

#: Bytes of keys per tile of the gather kernel: 256 keys of 128 float32 channels are 128 KB of keys and as much of
#: values, which stay in a 1 MB L2 while a tile is multiplied (128-512 keys measured within 5% at N = 32K).
TILE_BYTES = 128 << 10

#: Where a wheel puts its prebuilt libraries and ``build.json`` (the torch version they were built against).
PREBUILT_DIR = Path(__file__).with_name("_lib")

#: A cold JIT build on a quiet 2-core machine (13 files); measured 465-883 s on a busy one.
_JIT_SECONDS = 60

#: A build's lock file (torch's ``FileBaton``) older than this is left by a build that was killed: torch would wait on
#: it forever, so it is removed with a warning. Twice the slowest build measured on a busy machine.
STALE_LOCK_SECONDS = 1800

_lock = threading.Lock()
_module = None
_failure: str | None = None
_origin: str | None = None  # "prebuilt <path>" or "JIT <path>" once loaded
_note: str | None = None  # why the prebuilt library was not used, when it was not


class Status(NamedTuple):
    """Where qkv's compiled kernels stand in this process: ``state`` one of ``"prebuilt"``, ``"jit"``, ``"off"``
    (switched off or failed: ``reason`` says why), ``capability`` the build's (``AVX512``, ``AVX2``, ``DEFAULT``),
    ``path`` the loaded library (None when off), ``note`` why a prebuilt library was passed over (None if not)."""

    state: str
    capability: str
    path: str | None
    reason: str | None
    note: str | None


def capability() -> str:
    """This CPU's capability as torch reports it, reduced to a key of :data:`FLAGS` (AVX512_* -> AVX512)."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch: plain code
        return "DEFAULT"
    if cap.startswith("AVX512"):
        return "AVX512"
    return cap if cap in FLAGS else "DEFAULT"


def _prebuilt() -> tuple[Path | None, str | None]:
    """The best prebuilt library this CPU runs and this torch matches, or (None, why not; None: no wheel build)."""
    meta = PREBUILT_DIR / "build.json"
    if not meta.exists():
        return None, None
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        return None, f"the prebuilt kernels' {meta} cannot be read ({e})"
    built = info.get("torch")
    if built != torch.__version__:
        return None, (f"the prebuilt kernels were built against torch {built}, this is torch {torch.__version__} "
                      f"(their C++ ABI is pinned to it); reinstall qkv for this torch or let the JIT build run")
    mine = CAPABILITIES.index(capability())
    for cap in reversed(CAPABILITIES[:mine + 1]):
        path = PREBUILT_DIR / library_name(cap)
        if path.exists():
            return path, None
    return None, f"no prebuilt library in {PREBUILT_DIR} runs on this CPU ({capability()})"


def _jit_build():
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` package installs its binary beside this interpreter
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
    cap = capability()
    src = Path(__file__).with_name("csrc")
    name = f"qkv_cpu_kernels_{cap.lower()}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    where = Path(root) / name
    where.mkdir(parents=True, exist_ok=True)
    built = where / f"{name}.so"
    sources = [src / s for s in SOURCES]
    _clear_stale_lock(where / "lock")
    newest = max(p.stat().st_mtime for p in [*sources, *src.glob("*.h")])
    if not built.exists() or built.stat().st_mtime < newest:
        why = _note or "this is a source checkout (no prebuilt kernels in the install)"
        warnings.warn(f"qkv: building its compiled CPU kernels for {cap} ({len(SOURCES)} C++ files, "
                      f"torch.utils.cpp_extension into {built.parent}) because {why}; this takes about "
                      f"{_JIT_SECONDS} s on a quiet 2-core machine, several minutes on a busy one, and is done once "
                      f"(set {ENV}=0 to skip it and run the torch-op paths)", RuntimeWarning, stacklevel=4)
    cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=[*BASE_FLAGS, *FLAGS[cap]],
                       extra_ldflags=["-fopenmp"], build_directory=str(where), is_python_module=False,
                       verbose=False)
    return f"JIT {built}"


def _clear_stale_lock(lock: Path) -> None:
    """Remove a build lock that no live build can hold (older than :data:`STALE_LOCK_SECONDS`), saying so: torch's
    ``cpp_extension.load`` waits for the lock's file to go and would hang every later process on it."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"qkv: removing the build lock {lock}, left {age / 60:.0f} minutes ago by a build that did not "
                      f"finish (no build takes over {STALE_LOCK_SECONDS // 60} minutes)", RuntimeWarning, stacklevel=5)
        lock.unlink(missing_ok=True)


def _build():
    """Load the prebuilt library for this CPU and torch, else JIT-build one; returns where it came from."""
    global _note
    path, _note = _prebuilt()
    if path is not None:
        torch.ops.load_library(str(path))
        return f"prebuilt {path}"
    if _note is not None:
        warnings.warn(f"qkv: {_note}", RuntimeWarning, stacklevel=4)
    return _jit_build()


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
    """The operators' namespace ``torch.ops.qkv_cpu`` (the library loaded or built on first call), or ``None``
    where :func:`unavailable_reason` says why. Only :mod:`qkv.cpu` calls this."""
    global _module, _failure, _origin
    if _switched_off():
        return None
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is None and _failure is None:
            try:
                _origin = _build()
                fakes.register()
                _module = torch.ops.qkv_cpu
            except Exception as e:  # noqa: BLE001 - any build or import failure: say it once, use the torch paths
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _failure = (f"building qkv's CPU kernels failed ({type(e).__name__}: {first}); they need a C++ "
                            f"compiler and ninja (pip install ninja)")
                warnings.warn(f"{_failure}; the torch-op paths run instead", RuntimeWarning, stacklevel=2)
    return _module


def status() -> Status:
    """Where the kernels stand (loads or builds them first, unless switched off)."""
    why = unavailable_reason()
    if why is not None:
        return Status("off", capability(), None, why, _note)
    state, _, path = _origin.partition(" ")
    cap = Path(path).stem.rsplit("_", 1)[-1].upper()
    return Status(state.lower(), cap if cap in FLAGS else capability(), path, None, _note)


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
    if _module is None:
        load()
    return _failure
