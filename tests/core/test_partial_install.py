"""A partial install (``pip install -e .[test]``, no transformers) keeps every test that does not need it: files that
mix HF tests with others skip per test (``tests/_hf.py``'s ``OptionalModule``), never as a whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIXED = ["tests/models/test_gqa.py", "tests/costs/test_model_costs.py", "tests/interpret/test_capture.py",
         "tests/costs/test_layout_reader.py"]
BLOCKED = ("import sys; sys.modules['transformers'] = None; import pytest; "
           "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))")


def test_files_mixing_hf_and_plain_tests_keep_their_plain_tests_without_transformers():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the quiet collection's format
    r = subprocess.run([sys.executable, "-c", BLOCKED, *MIXED], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    counts = dict(line.rsplit(": ", 1) for line in r.stdout.splitlines() if line.startswith("tests/"))
    for f in MIXED:  # the quiet collection prints "file: count" per file
        assert int(counts.get(f, 0)) > 0, f"{f}: no test collected when transformers is missing\n{r.stdout[-1500:]}"
