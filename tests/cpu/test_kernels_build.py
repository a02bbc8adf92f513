"""Where qkv's compiled kernels come from (qkv.cpu.kernels): a prebuilt library of the installed package when it
matches this torch, else the JIT build, which says beforehand what it builds, why and about how long; a prebuilt
library built against another torch is passed over with a message naming both versions."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.cpu import kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """kernels as if not loaded yet, building into an empty extensions folder (the real build stubbed; the real
    library loaded first, so that its operators exist)."""
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build in the test environment: {kernels.unavailable_reason()}")
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "_origin", None)
    monkeypatch.setattr(kernels, "_note", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(kernels, "PREBUILT_DIR", tmp_path / "_lib")
    calls = []

    def load(**kw):
        calls.append(kw)
        return kw["build_directory"]

    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", load)
    return calls


def test_the_jit_build_says_what_why_and_how_long_before_it_starts(fresh):
    with pytest.warns(RuntimeWarning) as seen:
        assert kernels.load() is torch.ops.qkv_cpu
    text = " ".join(str(w.message) for w in seen)
    cap = kernels.capability()
    assert f"qkv: building its compiled CPU kernels for {cap} ({len(kernels.SOURCES)} C++ files" in text
    assert "because this is a source checkout (no prebuilt kernels in the install)" in text
    assert "about 60 s on a quiet 2-core machine" in text and f"{kernels.ENV}=0" in text
    assert len(fresh) == 1 and fresh[0]["is_python_module"] is False
    assert f"-DCPU_CAPABILITY={cap}" in fresh[0]["extra_cflags"] or cap == "DEFAULT"
    assert kernels.status().state == "jit"


def test_a_finished_build_is_loaded_without_a_message(fresh, tmp_path, recwarn):
    name = f"qkv_cpu_kernels_{kernels.capability().lower()}"
    (tmp_path / "ext" / name).mkdir(parents=True)
    (tmp_path / "ext" / name / f"{name}.so").write_bytes(b"")  # newer than every source
    assert kernels.load() is torch.ops.qkv_cpu
    assert not [w for w in recwarn if "building its compiled" in str(w.message)]


def test_a_prebuilt_library_for_another_torch_is_passed_over_with_a_message(fresh, tmp_path):
    lib = tmp_path / "_lib"
    lib.mkdir()
    (lib / "build.json").write_text(json.dumps({"torch": "2.0.0"}))
    (lib / kernels.library_name(kernels.capability())).write_bytes(b"")
    with pytest.warns(RuntimeWarning) as seen:
        kernels.load()
    text = " ".join(str(w.message) for w in seen)
    assert f"the prebuilt kernels were built against torch 2.0.0, this is torch {torch.__version__}" in text
    assert "reinstall qkv for this torch or let the JIT build run" in text
    assert "because the prebuilt kernels were built against torch 2.0.0" in text  # the JIT build says why
    st = kernels.status()
    assert st.state == "jit" and "2.0.0" in st.note


def test_the_best_prebuilt_library_this_cpu_runs_is_chosen(fresh, tmp_path, monkeypatch):
    lib = tmp_path / "_lib"
    lib.mkdir()
    (lib / "build.json").write_text(json.dumps({"torch": torch.__version__}))
    for cap in kernels.CAPABILITIES:
        (lib / kernels.library_name(cap)).write_bytes(b"")
    monkeypatch.setattr(kernels, "capability", lambda: "AVX2")
    assert kernels._prebuilt() == (lib / "qkv_cpu_avx2.so", None)
    (lib / "qkv_cpu_avx2.so").unlink()
    assert kernels._prebuilt() == (lib / "qkv_cpu_default.so", None)  # a lower width still runs here
    monkeypatch.setattr(kernels, "capability", lambda: "DEFAULT")
    (lib / "qkv_cpu_default.so").unlink()
    path, why = kernels._prebuilt()
    assert path is None and "no prebuilt library" in why and "runs on this CPU (DEFAULT)" in why


def test_switched_off_nothing_is_built(fresh, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels.load() is None and not fresh
    st = kernels.status()
    assert st.state == "off" and st.reason == f"{kernels.ENV}=0 in the environment" and st.path is None


def _lock(tmp_path, age_s: float):
    import os
    import time

    name = f"qkv_cpu_kernels_{kernels.capability().lower()}"
    lock = tmp_path / "ext" / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_left_by_a_killed_build_is_removed_with_a_message(fresh, tmp_path):
    lock = _lock(tmp_path, kernels.STALE_LOCK_SECONDS + 60)
    with pytest.warns(RuntimeWarning, match="removing the build lock .* by a build that did not finish"):
        assert kernels.load() is torch.ops.qkv_cpu
    assert not lock.exists() and len(fresh) == 1


def test_a_recent_lock_is_left_to_the_build_that_holds_it(fresh, tmp_path, recwarn):
    lock = _lock(tmp_path, 60)
    assert kernels.load() is torch.ops.qkv_cpu
    assert lock.exists(), "a build that may still be running keeps its lock"
    assert not [w for w in recwarn if "removing the build lock" in str(w.message)]
