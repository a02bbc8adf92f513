"""The paged block paths on hostile arguments, compiled kernel and torch ops alike (#46 items 2, 7, 8): every
block id of a table must lie in the pool, -1 and other negatives included (the kernels once took -1 as their "no
bad block" marker and skipped such a block, attending over fewer keys); both paths refuse the same tables with
the same ``ValueError``; zero KV heads are refused before any kernel runs (a division by the head count crashed
the process); a strided query and a call under autograd give the float64 reference's values and gradients."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.backends.paged import paged_decode_blocks, paged_prefill_blocks
from qkv.linear import gated_delta_chunked, gated_linear_chunked
from qkv.linear.gated_chunk import delta_path

pytestmark = [pytest.mark.xdist_group("cpu_kernels"), pytest.mark.usefixtures("kernel_path")]

P, HKV, T, D = 5, 2, 4, 8


def _case(seed: int = 0, dtype=torch.float32):
    """Row 0 holds 6 tokens in blocks 3, 1; row 1 holds 3 in block 4; table entry (1, 1) is filler (block 0)."""
    g = torch.Generator().manual_seed(seed)
    kp, vp = torch.randn(2, P, HKV, T, D, generator=g, dtype=dtype).unbind(0)
    tables = torch.tensor([[3, 1], [4, 0]])
    kpos = torch.tensor([[0, 1, 2, 3, 4, 5, -1, -1], [0, 1, 2, -1, -1, -1, -1, -1]])
    return kp, vp, tables, kpos


def _call(kind: str, q4, kp, vp, tables, kpos):
    if kind == "decode":
        return paged_decode_blocks(q4[:, :, -1], kp, vp, tables, kpos, torch.tensor([5, 2]))
    return paged_prefill_blocks(q4, kp, vp, tables, kpos, torch.tensor([[4, 5], [1, 2]]))


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("entry", [(0, 1), (1, 1)], ids=["visible_slot", "filler_entry"])
@pytest.mark.parametrize("bad", [-1, -7, P, 10**6])
def test_every_table_id_outside_the_pool_is_refused(kind, entry, bad):
    kp, vp, tables, kpos = _case()
    q = torch.randn(2, 4, 2, D)
    _call(kind, q, kp, vp, tables, kpos)  # the clean table runs
    tables[entry] = bad
    with pytest.raises(ValueError, match=rf"block_tables name a block outside the pool of {P} blocks.*{bad}"):
        _call(kind, q, kp, vp, tables, kpos)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_zero_kv_heads_are_refused_before_any_kernel(kind):
    kp, vp, tables, kpos = _case()
    with pytest.raises(ValueError, match="Hkv >= 1"):
        _call(kind, torch.randn(2, 4, 2, D), kp[:, :0], vp[:, :0], tables, kpos)


@pytest.mark.parametrize("fn", [gated_delta_chunked, gated_linear_chunked, delta_path])
def test_zero_key_heads_of_the_gated_rules_are_refused(fn):
    q = k = torch.randn(1, 0, 5, 4)
    v, g, beta = torch.randn(1, 2, 5, 4), -torch.rand(1, 2, 5), torch.rand(1, 2, 5)
    args = (q, k, v, g) if fn is gated_linear_chunked else (q, k, v, g, beta)
    with pytest.raises(ValueError, match="0 heads"):
        fn(*args)


def _reference(q, kp, vp, tables, kpos, qpos):
    B = q.shape[0]
    k = kp[tables].permute(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)
    v = vp[tables].permute(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)
    return qkv.attention(q[:, :, None], k, v, mask=M.positions(qpos[:, None], kpos, causal=True),
                         backend="reference").squeeze(2)


def test_decode_takes_a_strided_query():
    kp, vp, tables, kpos = _case(1)
    wide = torch.randn(2, 4, 2 * D)
    q = wide[:, :, ::2]  # last stride 2
    out, _ = paged_decode_blocks(q, kp, vp, tables, kpos, torch.tensor([5, 2]))
    ref = _reference(q.double(), kp.double(), vp.double(), tables, kpos, torch.tensor([5, 2]))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_under_autograd_gives_the_reference_gradients():
    """With gradients asked for, the torch ops run (the kernel has no backward) and their gradients equal the
    float64 reference's (the in-place softmax once broke the backward)."""
    kp, vp, tables, kpos = _case(2, torch.float64)
    q = torch.randn(2, 4, D, dtype=torch.float64)
    qpos = torch.tensor([5, 2])
    dout = torch.randn(2, 4, D, dtype=torch.float64)
    grads = []
    for fn in (lambda *a: paged_decode_blocks(*a, qpos)[0], lambda *a: _reference(*a, qpos)):
        leaves = [t.clone().requires_grad_() for t in (q, kp, vp)]
        out = fn(leaves[0], leaves[1], leaves[2], tables, kpos)
        (out * dout).sum().backward()
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(("q", "k_pool", "v_pool"), *grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=f"d{name}")
