"""Shared fixtures of the CPU product tests."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch

from qkv.cpu import rule
from qkv.cpu.rule import Band, switches

#: The product table fitted on a 2-core AMD EPYC (2026-12-04), where row blocks won 1-2 rows of the short class and
#: 1-2 (1-4 at two threads) of the narrow one. The committed table follows this machine's measurements and may take
#: row blocks nowhere; tests of the row-block and column-block mechanics pin this one (``row_block_table``).
ROW_BLOCK_TABLE = MappingProxyType({
    (1, "narrow"): switches(2, 3),
    (1, "short"): (Band(1, "row_blocks", "row_blocks", "columns", "columns"),
                   Band(2, "row_blocks", "row_blocks", "onednn", "columns"),
                   Band(8, "onednn", "row_blocks", "onednn", "columns"),
                   Band(32, "onednn", "linear", "onednn", "columns")),
    (1, "wide"): (Band(1, "linear", "linear", "linear", "linear"),
                  Band(2, "onednn", "linear", "onednn", "linear"),
                  Band(4, "onednn", "row_blocks", "onednn", "columns"),
                  Band(12, "onednn", "linear", "onednn", "columns"),
                  Band(32, "onednn", "row_blocks", "onednn", "columns")),
    (1, "long"): (Band(1, "linear", "linear", "linear", "linear"),
                  Band(2, "onednn", "linear", "onednn", "linear"),
                  Band(12, "onednn", "linear", "onednn", "columns"),
                  Band(16, "onednn", "row_blocks", "onednn", "columns"),
                  Band(24, "onednn", "linear", "onednn", "columns"),
                  Band(32, "onednn", "row_blocks", "onednn", "columns")),
    (2, "narrow"): switches(4, 3),
    (2, "short"): (Band(1, "row_blocks", "row_blocks", "columns", "columns"),
                   Band(2, "row_blocks", "row_blocks", "onednn", "columns"),
                   Band(32, "onednn", "row_blocks", "onednn", "columns")),
    (2, "wide"): (Band(32, "onednn", "row_blocks", "onednn", "columns"),),
    (2, "long"): (Band(1, "onednn", "row_blocks", "columns", "columns"),
                  Band(32, "onednn", "row_blocks", "onednn", "columns")),
})


@pytest.fixture
def row_block_table(monkeypatch):
    """:data:`ROW_BLOCK_TABLE` in force (the rule's answers memoized for the table in force are dropped)."""
    monkeypatch.setattr(rule, "TABLE", ROW_BLOCK_TABLE)
    yield ROW_BLOCK_TABLE


@pytest.fixture
def two_threads():
    """Torch's intra-op threads set to 2 for the test, put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
