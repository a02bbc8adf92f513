"""Builds qkv's compiled CPU kernels into the wheel: one shared library per CPU capability (DEFAULT, AVX2, AVX512,
as ATen's CPU_CAPABILITY), loaded at run time with ``torch.ops.load_library`` by ``qkv.cpu.kernels``, which picks
the best one the CPU runs and refuses (with a message, then builds by JIT) a torch other than the one they were built
against (recorded in ``qkv/cpu/_lib/build.json``).

    pip wheel . --no-build-isolation --no-deps -w dist     # make wheel; uses the torch installed here

``QKV_CPU_CAPABILITIES=AVX512`` (comma-separated) restricts the capabilities built. Without torch in the build
environment (pip's default isolated build) the wheel carries no kernels and qkv builds them by JIT at first use, as
a source checkout does; a warning says so. Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent


def _kernel_spec():
    """``qkv/cpu/build.py`` (sources, flags, capabilities), read without importing qkv: torch may be absent."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_qkv_cpu_build", HERE / "src" / "qkv" / "cpu" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _extensions():
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        warnings.warn("qkv: torch is not importable in this build environment, so the wheel carries no compiled "
                      "kernels (qkv builds them by JIT at first use); build with `pip wheel . --no-build-isolation` "
                      "in an environment with torch to ship them", stacklevel=1)
        return [], {}
    k = _kernel_spec()
    wanted = os.environ.get(k.CAPABILITIES_ENV)
    caps = [c.strip().upper() for c in wanted.split(",") if c.strip()] if wanted else list(k.CAPABILITIES)
    unknown = sorted(set(caps) - set(k.CAPABILITIES))
    if unknown:
        raise ValueError(f"{k.CAPABILITIES_ENV}={wanted!r}: unknown capabilities {unknown}; choose from "
                         f"{', '.join(k.CAPABILITIES)}")
    sources = [str(Path("src/qkv/cpu/csrc") / s) for s in k.SOURCES]
    exts = [CppExtension(name=f"qkv.cpu._lib.{Path(k.library_name(cap)).stem}", sources=sources,
                         # -g0: no debug info (Python's own CFLAGS carry -g), a smaller wheel and a shorter build
                         extra_compile_args=[*k.BASE_FLAGS, *k.FLAGS[cap], "-g0"], extra_link_args=["-fopenmp"])
            for cap in caps]

    class _Build(BuildExtension):
        """BuildExtension, then ``_lib/build.json``: the torch version the libraries are pinned to."""

        def run(self):
            super().run()
            out = Path(self.build_lib) / "qkv" / "cpu" / "_lib"
            out.mkdir(parents=True, exist_ok=True)
            (out / "build.json").write_text(json.dumps({"torch": torch.__version__, "capabilities": caps}) + "\n")

    return exts, {"build_ext": _Build.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
