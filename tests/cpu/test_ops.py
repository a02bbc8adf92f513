"""qkv's compiled kernels as torch operators (``torch.ops.qkv_cpu.<name>``, :mod:`qkv.cpu.ops`): every operator's
fake implementation gives the shapes, dtypes and strides its kernel gives (FakeTensorMode, and
``torch.library.opcheck``'s schema and fake checks), every operator refuses inputs that require a gradient by name,
and the facade's eligibility tests say why a kernel does not run."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qkv.cpu import fakes, kernels, ops
from qkv.cpu.greedy import screen_unavailable_reason


@pytest.fixture(autouse=True)
def _kernels():
    if ops.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build in the test environment: {ops.unavailable_reason()}")


def _inputs(name: str) -> tuple:
    """Valid arguments of operator ``name``, fresh random values (float32, small awkward sizes)."""
    r = torch.randn
    long = torch.long
    if name == "rms_norm":
        return r(3, 5, 7), r(7), 1e-6, 0.0
    if name == "silu_mul":
        return (r(3, 5, 14),)
    if name == "rotary":
        return r(2, 3, 5, 8), r(2, 5, 6), r(2, 5, 6), False
    if name == "rows_linear":
        return r(2, 3, 16), r(9, 16), r(9), 2
    if name == "weight_linear":
        return r(2, 3, 16), torch.randint(-127, 128, (9, 16), dtype=torch.int8), torch.rand(9), r(9)
    if name == "moe_token":
        return r(1, 16), [2, 0], torch.rand(2), r(4, 10, 16), None, r(4, 16, 5), None, False, 0.0, 0.0, 1, 1
    if name == "moe_grouped":
        return (r(3, 16), torch.tensor([0, 2, 1, 0, 2, 1]), torch.rand(6), [2, 2, 1, 1], r(4, 10, 16), r(4, 10),
                r(4, 16, 5), r(4, 16), True, 1.7, 7.0, [1] * 4, [1] * 4)
    if name == "decode_attention":
        return (r(2, 4, 1, 8), r(2, 2, 6, 8), r(2, 2, 6, 8), torch.full((2, 1), 5, dtype=long),
                torch.arange(6).expand(2, 6).contiguous(), True, 0, None, 8 ** -0.5)
    if name in ("paged_decode", "paged_prefill"):
        q = r(2, 4, 8) if name == "paged_decode" else r(2, 4, 3, 8)
        q_pos = torch.full((2,), 7, dtype=long) if name == "paged_decode" else torch.tensor([[5, 6, 7]] * 2)
        kv_pos = torch.arange(8).expand(2, 8).contiguous()
        return q, r(3, 2, 4, 8), r(3, 2, 4, 6), torch.tensor([[0, 1], [2, 0]]), kv_pos, q_pos, 8 ** -0.5, 0, True, r(4)
    if name == "paged_store":
        return (r(3, 2, 4, 8), r(3, 2, 4, 6), r(2, 2, 1, 8), r(2, 2, 1, 6), torch.tensor([1, 2]), torch.tensor([3, 0]),
                torch.tensor([0, 1]))
    if name == "gather_attention":
        return r(1, 2, 3, 8), r(1, 2, 5, 8), r(1, 2, 5, 6), torch.randint(0, 5, (1, 2, 3, 2)), 0.3, False, 0, None, 16
    if name == "gated_delta_chunks":
        k = torch.nn.functional.normalize(r(1, 1, 5, 4), dim=-1)
        return r(1, 1, 5, 4), k, r(1, 2, 5, 3), -torch.rand(1, 2, 5), torch.rand(1, 2, 5), r(1, 2, 4, 3), 4, 16.0
    if name == "delta_decode":
        return r(1, 10), r(1, 10, 3), r(10, 4), -torch.rand(1, 2), torch.rand(1, 2), r(1, 2, 3, 2), 1, 0.5, 1e-6
    if name == "screen_pack":
        return (r(70, 16),)
    if name == "screened_argmax":
        w = r(70, 16)
        return (r(3, 16), w, *fakes._screen_pack(w))
    raise AssertionError(name)


def _runs(name: str) -> bool:
    return not name.startswith("screen") or screen_unavailable_reason() is None


@pytest.mark.parametrize("name", ops.OPERATORS)
def test_each_operator_is_registered_under_qkv_cpu(name):
    op = getattr(torch.ops.qkv_cpu, name).default
    assert op.name() == f"qkv_cpu::{name}"
    mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == (["k_pool", "v_pool"] if name == "paged_store" else [])


def _meta(t):
    return (tuple(t.shape), t.dtype, tuple(t.stride())) if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("name", ops.OPERATORS)
def test_the_fake_implementation_gives_the_kernels_shapes(name):
    args = _inputs(name)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = getattr(torch.ops.qkv_cpu, name)(*fake_args)
    fake = fake if isinstance(fake, (list, tuple)) else [fake]
    if not _runs(name):
        assert all(t.device.type == "cpu" for t in fake if t is not None)
        pytest.skip(f"the screen does not run here ({screen_unavailable_reason()}); its fake shapes were traced")
    real = getattr(torch.ops.qkv_cpu, name)(*args)
    real = real if isinstance(real, (list, tuple)) else [real]
    assert [_meta(t) for t in fake] == [_meta(t) for t in real]


@pytest.mark.parametrize("name", [n for n in ops.OPERATORS if not n.startswith("screen")])
def test_opcheck_schema_and_fake(name):
    torch.library.opcheck(getattr(torch.ops.qkv_cpu, name).default, _inputs(name),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", [n for n in ops.OPERATORS if n != "screened_argmax"])
def test_an_input_that_requires_a_gradient_is_refused_by_name(name):
    args = list(_inputs(name))
    first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point())
    args[first] = args[first].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=rf"qkv_cpu::{name} has no backward: its argument '\w+' requires a "
                                           r"gradient; call it under torch.no_grad\(\)"):
        getattr(ops, name)(*args)
    if _runs(name):
        with torch.no_grad():  # the same call without recording runs
            getattr(ops, name)(*args)


def test_the_refusal_names_the_argument_that_requires_a_gradient():
    x, w, eps, off = _inputs("rms_norm")
    with pytest.raises(RuntimeError, match="its argument 'weight' requires"):
        ops.rms_norm(x, w.requires_grad_(), eps, off)


def test_eligibility_reasons():
    x, w = torch.randn(3, 8), torch.randn(8)
    assert ops.why_not_rms_norm(x, w) is None
    assert ops.why_not_rms_norm(x.half(), w.half()) == "qkv_cpu::rms_norm runs float32/float64/bfloat16, got float16"
    assert ops.why_not_rms_norm(x, w.double()) == ("qkv_cpu::rms_norm needs one dtype, got torch.float32 and "
                                                    "torch.float64")
    assert ops.why_not_rms_norm(x, w.requires_grad_()) == "autograd records this call (qkv_cpu::rms_norm has no " \
                                                          "backward)"
    with torch.no_grad():
        assert ops.why_not_rms_norm(x, w) is None
    assert "unit last stride" in ops.why_not_silu_mul(torch.randn(8, 3).t())
    assert "unit last stride" in ops.why_not_silu_mul(torch.randn(3, 7))
    assert ops.why_not_silu_mul(torch.randn(3, 8)) is None
    assert ops.why_not_rotary(torch.randn(1, 1, 2, 4).bfloat16(), torch.randn(2, 4), torch.randn(2, 4)) is None
    up, down = torch.randn(2, 8, 4), torch.randn(2, 4, 4)
    assert ops.why_not_experts(torch.randn(1, 4), up, down) is None
    assert "contiguous" in ops.why_not_experts(torch.randn(1, 4), up.transpose(1, 2), down)
    assert ops.why_not_gated_delta_chunks(x, None, w.detach()) is None


def test_switched_off_every_reason_says_so(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "0")
    x, w = torch.randn(3, 8), torch.randn(8)
    for why in (ops.why_not_rms_norm(x, w), ops.why_not_silu_mul(x), ops.why_not_decode_attention(x),
                ops.unavailable_reason()):
        assert why == f"{kernels.ENV}=0 in the environment"
    with pytest.raises(RuntimeError, match=f"unavailable: {kernels.ENV}=0 in the environment; ask"):
        ops.rms_norm(x, w, 1e-6, 0.0)
    assert not ops.available()


def test_a_meta_device_tensor_is_not_eligible():
    x = torch.empty(3, 8, device="meta")
    assert ops.why_not_rms_norm(x, x[0]) == "qkv_cpu::rms_norm is CPU only, got a tensor on meta"


def test_kernels_load_returns_the_operator_namespace():
    assert kernels.load() is torch.ops.qkv_cpu
    st = kernels.status()
    assert st.state in ("prebuilt", "jit") and st.reason is None and st.capability in kernels.CAPABILITIES
