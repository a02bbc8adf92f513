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

ROOT = Path(__file__).resolve().parents[2]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 8


def test_readme_blocks_run_in_order(tmp_path):
    runnable = [b for b in _blocks() if "inside torchrun" not in b.splitlines()[0]]
    script = "\n".join(f"# --- README block {i}\n{b}" for i, b in enumerate(runnable))
    (tmp_path / "readme.py").write_text(script)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"a README block failed:\n{proc.stderr[-4000:]}"
    assert (tmp_path / "view.html").stat().st_size > 1000


def test_torchrun_block_names_real_calls():
    import qkv.distributed as cp

    (block,) = [b for b in _blocks() if "inside torchrun" in b.splitlines()[0]]
    for name in re.findall(r"\bcp\.(\w+)\(", block):
        assert callable(getattr(cp, name, None)), f"README calls qkv.distributed.{name}, which does not exist"
    assert textwrap.dedent(block).strip()
