"""Test-session settings shared by every test file.

The suite runs with two pytest-xdist workers on two cores; torch's default of one intra-op thread per
core would make each worker spin against the other, so every worker uses a single thread.

``--expected-skips FILE`` (``make test`` passes ``tests/skips/full.txt``): every skip's reason must match one of
the file's regular expressions, or the run fails and lists the others, so a missing dependency or a broken
import cannot hide as a skip. ``tests/skips/partial.txt`` lists what a partial install
(``pip install -e .[test]``, no transformers, tokenizers, bundled model or browser) may skip.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

_skips: list[tuple[str, str]] = []


def pytest_addoption(parser):
    parser.addoption("--expected-skips", default=None, metavar="FILE",
                     help="a file of regular expressions (one per line, # comments); a skip whose reason matches "
                          "none of them fails the run")


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        _skips.append((report.nodeid, str(report.longrepr[2])))


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--expected-skips")
    if path is None or hasattr(session.config, "workerinput"):  # checked once, by the controller
        return
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    allowed = [re.compile(line) for line in (x.strip() for x in lines) if line and not line.startswith("#")]
    unexpected = [(node, why) for node, why in _skips if not any(p.search(why) for p in allowed)]
    if unexpected:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "\n".join(f"  {node}: {why}" for node, why in unexpected)
        message = f"{len(unexpected)} skip(s) not expected by {path}:\n{text}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
