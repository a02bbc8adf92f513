"""A kernel right in everything but its lse's base (base 2, as FlashInfer's): the battery names the base once, and
every later check that reads the lse (masked rows, sinks, empty keys, ...) reads it converted, so they all pass
(#46: the later LSE checks were never run on a base-2 kernel)."""

from __future__ import annotations

import math

from qkv import conformance
from qkv.conformance import adapters

_good = adapters.qkv_backend("reference")


def _right_but_base2(q, k, v, *, causal=False, window=None, sinks=None, softcap=None, scale=None, return_lse=False):
    res = _good(q, k, v, causal=causal, window=window, sinks=sinks, softcap=softcap, scale=scale,
                return_lse=return_lse)
    return (res[0], res[1] / math.log(2.0)) if return_lse else res


def test_a_base2_kernel_fails_only_the_base_check():
    report = conformance.check(_right_but_base2)
    base = report.finding("lse_base")
    assert base.ok is False and "2" in base.seen, report.table()
    others = [f for f in report.findings if f.check not in ("lse_base",)]
    assert {f.check for f in report.findings} == set(conformance.CHECKS)
    assert all(f.ok is True for f in others), report.table()
