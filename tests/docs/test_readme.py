"""The README's Python blocks run as written, in order, in one namespace (a reader pastes them in order).

A block whose first line says it runs ``inside torchrun`` needs several processes; it is checked to name
calls that exist, and the example it points to runs in tests/test_distributed.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 5  # the rest of the tour lives in docs/guide.md, executed by the docs build


def _absent_imports(block: str) -> list[str]:
    """The top-level packages a block imports that this install lacks (a partial install: no transformers)."""
    import importlib.util

    names = re.findall(r"^\s*(?:import|from)\s+([\w., ]+?)(?:\s+import\b|\s+as\b|$)", block, re.M)
    tops = {part.strip().split(".")[0] for name in names for part in name.split(",") if part.strip()}
    return sorted(t for t in tops if importlib.util.find_spec(t) is None)


def test_readme_blocks_run_in_order(tmp_path):
    """Every block runs; on an install without a block's optional package the others run and the test then
    skips naming the blocks left out."""
    blocks = [b for b in _blocks() if "inside torchrun" not in b.splitlines()[0]]
    left_out = {i: _absent_imports(b) for i, b in enumerate(blocks) if _absent_imports(b)}
    runnable = [b for i, b in enumerate(blocks) if i not in left_out]
    script = "\n".join(f"# --- README block {i}\n{b}" for i, b in enumerate(runnable))
    (tmp_path / "readme.py").write_text(script)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"a README block failed:\n{proc.stderr[-4000:]}"
    assert (tmp_path / "view.html").stat().st_size > 1000
    if left_out:
        pytest.skip("README blocks left out, the rest ran: " + "; ".join(
            f"block {i} needs {', '.join(mods)}, not installed" for i, mods in left_out.items()))


def test_torchrun_block_names_real_calls():
    import qkv.distributed as cp

    (block,) = [b for b in _blocks() if "inside torchrun" in b.splitlines()[0]]
    for name in re.findall(r"\bcp\.(\w+)\(", block):
        assert callable(getattr(cp, name, None)), f"README calls qkv.distributed.{name}, which does not exist"
    assert textwrap.dedent(block).strip()
