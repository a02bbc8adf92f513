"""Packaging metadata that installers read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_license_is_an_spdx_expression():
    """PEP 639: ``project.license`` is an SPDX string; the old ``{text = ...}`` table is deprecated and
    setuptools warns about it on every install (setuptools>=77 reads the string form)."""
    data = tomllib.loads(PYPROJECT.read_text())
    license_ = data["project"]["license"]
    assert isinstance(license_, str) and license_ == "Apache-2.0", license_
    assert "License ::" not in " ".join(data["project"].get("classifiers", [])), "a license classifier conflicts"
    needs = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools\s*>=\s*(\d+)(\.\d+)*", needs[0]) if needs else None
    assert floor is not None and int(floor.group(1)) >= 77, f"build needs setuptools>=77 for the string form: {needs}"
