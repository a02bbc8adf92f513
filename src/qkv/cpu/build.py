"""What qkv's compiled CPU library is built from, read by both builders: the JIT build of :mod:`qkv.cpu.kernels` and
the wheel build of ``setup.py`` (which reads this file without importing qkv or torch, so it imports neither).

Example:
    >>> from qkv.cpu.build import CAPABILITIES, library_name
    >>> CAPABILITIES, library_name("AVX2")
    (('DEFAULT', 'AVX2', 'AVX512'), 'qkv_cpu_avx2.so')
"""

from __future__ import annotations

__all__ = ["SOURCES", "FLAGS", "BASE_FLAGS", "CAPABILITIES", "CAPABILITIES_ENV", "library_name"]

#: The C++ files of the library, ``csrc/`` relative.
SOURCES = ("module.cpp", "gather_attention.cpp", "gated_delta.cpp", "delta_decode.cpp", "products.cpp",
           "rotary.cpp", "norms.cpp", "decode_attention.cpp", "paged_decode.cpp",
           "paged_prefill.cpp", "paged_store.cpp", "activations.cpp", "greedy_head.cpp",
           "weight_linear.cpp")

#: torch's own CPU capability names, lowest first -> the flags that give ATen's vector types that width.
FLAGS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
}
CAPABILITIES = tuple(FLAGS)

#: Compiler flags of every build: no fused multiply-adds but the kernels' own (kernels that redo torch's arithmetic,
#: rotary and SwiGLU's gate, give its values bit for bit only when a * b + c rounds twice, as torch's separate ops
#: do), OpenMP so that ``at::parallel_for`` spreads over torch's threads (the process's one OpenMP runtime).
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]

#: Comma-separated capabilities a wheel build compiles (``setup.py``; e.g. ``AVX512`` for this machine's only).
CAPABILITIES_ENV = "QKV_CPU_CAPABILITIES"


def library_name(cap: str) -> str:
    """The file name of the library built for capability ``cap`` (a key of :data:`FLAGS`)."""
    return f"qkv_cpu_{cap.lower()}.so"
