"""The wheel ships the compiled kernels: ``pip wheel . --no-build-isolation`` (this machine's CPU capability only,
``QKV_CPU_CAPABILITIES``) carries ``qkv/cpu/_lib/qkv_cpu_<capability>.so`` and ``build.json``; installed into a clean
virtual environment (torch made visible by a ``.pth`` line, nothing recompiled) with no C++ compiler reachable (PATH
holds the environment's own bin only, ``CC``/``CXX`` are ``/bin/false``) and an empty extensions folder, qkv loads the
prebuilt library, runs a kernel, and a first ``generate`` compiles nothing.

It builds 13 C++ files (about 2-4 minutes on 2 busy cores), so it runs on its own xdist worker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from qkv.cpu import kernels

pytestmark = [pytest.mark.xdist_group("wheel"), pytest.mark.wheel]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import os, sys, warnings
warnings.simplefilter("error", RuntimeWarning)  # a JIT build or a passed-over library would warn
import torch, torch.nn.functional as F
import qkv
from qkv.cpu import kernels, ops
assert qkv.__file__.startswith(sys.prefix), qkv.__file__
st = kernels.status()
assert st.state == "prebuilt", st
x, w = torch.randn(3, 64), torch.randn(64)
y = ops.rms_norm(x, w, 1e-6, 0.0)
assert torch.allclose(y, F.rms_norm(x, (64,), w, 1e-6), atol=1e-5)
from qkv.models.generate import generate
from qkv.nn import DecoderLM, get_config
model = DecoderLM(get_config("tiny-llama")).eval()
with torch.inference_mode():
    out = generate(model, torch.randint(0, 100, (1, 5)), max_new_tokens=3)
assert out.new_tokens.shape == (1, 3)
assert not os.listdir(os.environ["TORCH_EXTENSIONS_DIR"]), "something was compiled"
print("prebuilt", st.capability, st.path)
"""


def _copy_tree(dst: Path) -> None:
    """The files a wheel is built from (no build outputs, caches or prebuilt libraries of this checkout)."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "src", dst / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "_lib", "*.egg-info", "*.so"))


def test_the_wheel_carries_the_kernels_and_runs_them_without_a_compiler(tmp_path):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("building the wheel needs a C++ compiler")
    cap = kernels.capability()
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    _copy_tree(src)
    env = {**os.environ, "QKV_CPU_CAPABILITIES": cap, "MAX_JOBS": str(os.cpu_count() or 2)}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-build-isolation", "--no-deps",
                            "--no-index", "-w", str(dist)], env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("qkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert f"qkv/cpu/_lib/{kernels.library_name(cap)}" in names, names
    assert "qkv/cpu/_lib/build.json" in names and "qkv/cpu/csrc/module.cpp" in names
    assert not any(n.startswith("qkv/cpu/_lib/") and n.endswith(".so") and cap.lower() not in n for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_torch_here.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch and the deps, as installed
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    ext = tmp_path / "ext"
    ext.mkdir()
    clean = {"PATH": str(venv / "bin"), "CC": "/bin/false", "CXX": "/bin/false", "HOME": str(tmp_path),
             "TORCH_EXTENSIONS_DIR": str(ext), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    assert shutil.which("c++", path=clean["PATH"]) is None and shutil.which("gcc", path=clean["PATH"]) is None
    run = subprocess.run([str(py), "-c", _SCRIPT], env=clean, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith(f"prebuilt {cap} ") and str(site) in run.stdout
