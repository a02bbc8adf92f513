"""The standing bad-input harness.

Each class of bad input is tried on every backend and on every public entry point that takes it: the
operator, masks, modifiers, the KV cache, ``generate``, ``verify_cache``, ``from_hf`` and the CLI. Every case
asserts the error type, that the message names the argument (or file) at fault, and that nothing changed: a
cache refused a write holds what it held, a checkpoint directory or config file is byte-identical afterwards.
Hypothesis draws malformed operator calls (one broken property at a time) on top of the tables.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
from qkv import masks as M
from qkv import mods
from qkv.cache import KIVI, Dynamic, FullSpec, KVCache, Paged, SlidingWindowSpec, Static

BACKENDS = ["auto", "reference", "sdpa", "tiled", "flex"]


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


Q = _x(1, 2, 4, 8)

# id -> (call kwargs for qkv.attention (q, k, v included), error type, regex the message must match)
OPERATOR = {
    "q-not-a-tensor": (dict(q=[[1.0]], k=Q, v=Q), TypeError, r"\bq\b.*torch.Tensor"),
    "q-rank3": (dict(q=_x(2, 4, 8), k=Q, v=Q), ValueError, r"\bq\b.*rank 4"),
    "k-int": (dict(q=Q, k=torch.ones(1, 2, 4, 8, dtype=torch.int32), v=Q), TypeError, r"\bk\b.*dtype"),
    "v-complex": (dict(q=Q, k=Q, v=Q.to(torch.complex64)), TypeError, r"\bv\b.*dtype"),
    "dtypes-differ": (dict(q=Q, k=Q.double(), v=Q), TypeError, r"q, k, v.*dtype"),
    "batch-differs": (dict(q=_x(2, 2, 4, 8), k=Q, v=Q), ValueError, r"batch"),
    "kv-heads-differ": (dict(q=Q, k=_x(1, 2, 4, 8), v=_x(1, 1, 4, 8)), ValueError, r"k and v.*heads"),
    "kv-lengths-differ": (dict(q=Q, k=_x(1, 2, 5, 8), v=Q), ValueError, r"k and v.*length"),
    "head-dims-differ": (dict(q=Q, k=_x(1, 2, 4, 6), v=Q), ValueError, r"q and k.*head dim"),
    "heads-not-multiple": (dict(q=_x(1, 3, 4, 8), k=Q, v=Q), ValueError, r"query heads.*multiple"),
    "scale-nan": (dict(q=Q, k=Q, v=Q, scale=float("nan")), ValueError, r"scale.*finite"),
    "scale-str": (dict(q=Q, k=Q, v=Q, scale="0.1"), TypeError, r"scale"),
    "mask-tensor": (dict(q=Q, k=Q, v=Q, mask=torch.ones(4, 4, dtype=torch.bool)), TypeError, r"mask.*masks.dense"),
    "mask-uncalled": (dict(q=Q, k=Q, v=Q, mask=M.causal), TypeError, r"mask.*causal\(\)"),
    "mask-batch": (dict(q=Q, k=Q, v=Q, mask=M.padding([1, 2, 3])), ValueError, r"batch"),
    "mask-too-long": (dict(q=Q, k=Q, v=Q, mask=M.padding([9])), ValueError, r"kv_lengths"),
    "mask-meta": (dict(q=Q, k=Q, v=Q, mask=M.dense(torch.ones(4, 4, dtype=torch.bool, device="meta"))), ValueError,
                  r"mask.*meta"),
    "document-ids-length": (dict(q=Q, k=Q, v=Q, mask=M.document(torch.zeros(5, dtype=torch.long))), ValueError,
                            r"document: ids"),
    "document-nq-gt-nk": (dict(q=_x(1, 2, 6, 8), k=Q, v=Q, mask=M.document(torch.zeros(4, dtype=torch.long))),
                          ValueError, r"q_ids"),
    "score-mod-function": (dict(q=Q, k=Q, v=Q, score_mod=lambda s, b, h, q, k: s), TypeError,
                           r"score_mod.*from_fn"),
    "score-mod-list-item": (dict(q=Q, k=Q, v=Q, score_mod=[mods.softcap(5.0), 3]), TypeError, r"score_mod"),
    "score-mod-meta": (dict(q=Q, k=Q, v=Q, score_mod=mods.bias(torch.zeros(4, 4, device="meta"))), ValueError,
                       r"score_mod.*meta"),
    "bias-shape": (dict(q=Q, k=Q, v=Q, score_mod=mods.bias(torch.zeros(3, 4))), ValueError, r"bias.*broadcast"),
    "alibi-heads": (dict(q=Q, k=Q, v=Q, score_mod=mods.alibi(torch.ones(3))), ValueError, r"alibi.*slopes"),
    "relative-bias-negative-bucket": (dict(q=Q, k=Q, v=Q, score_mod=mods.relative_bias(torch.zeros(8, 2),
                                                                                         lambda d: d)),
                                      ValueError, r"relative_bias.*bucket"),
    "dropout-above-1": (dict(q=Q, k=Q, v=Q, dropout_p=1.5), ValueError, r"dropout_p"),
    "generator-wrong": (dict(q=Q, k=Q, v=Q, generator=0), TypeError, r"generator"),
    # issue 29 item 24: the hint names what fixes it
    "mask-float-tensor": (dict(q=Q, k=Q, v=Q, mask=torch.zeros(4, 4)), TypeError, r"mask.*score_mod=qkv.mods.bias"),
    "is-causal-keyword": (dict(q=Q, k=Q, v=Q, is_causal=True), TypeError, r"is_causal.*masks.causal"),
    "attn-mask-keyword": (dict(q=Q, k=Q, v=Q, attn_mask=torch.ones(4, 4, dtype=torch.bool)), TypeError,
                          r"attn_mask.*masks.dense"),
}

# Errors the layout cannot fix: q, k, v of (2, 100, 8, 16) would fit (B, N, H, D), but the call would still fail
# there, so the message must not suggest layout='bnhd' (issue 29 item 24).
_X = _x(2, 100, 8, 16)
NO_LAYOUT_HINT = {
    "dense-mask-size": dict(mask=M.dense(torch.ones(10, 10, dtype=torch.bool))),
    "alibi-slopes": dict(score_mod=mods.alibi(torch.ones(4))),
    "sinks-length": dict(sinks=torch.zeros(3)),
    "padding-batch": dict(mask=M.padding([1, 2, 3])),
}


@pytest.mark.parametrize("case", list(NO_LAYOUT_HINT))
def test_layout_hint_only_when_the_other_layout_would_run(case):
    with pytest.raises(ValueError) as info:
        qkv.attention(_X, _X, _X, **NO_LAYOUT_HINT[case])
    assert "layout=" not in str(info.value), str(info.value)


def test_layout_hint_kept_when_the_other_layout_runs():
    with pytest.raises(ValueError, match="layout='bnhd'"):
        qkv.attention(_X, _X, _X, mask=M.dense(torch.ones(100, 100, dtype=torch.bool)))


def test_tiled_head_dim_zero_is_declined_with_the_reason():
    z = _x(1, 2, 4, 0)
    with pytest.raises(ValueError, match=r"tiled.*head dim 0"):
        qkv.attention(z, z, z, backend="tiled")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(OPERATOR))
def test_operator_bad_input(case, backend):
    kw, exc, pattern = OPERATOR[case]
    kw = dict(kw)
    with pytest.raises(exc, match=pattern):
        qkv.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), backend=backend, **kw)


@pytest.mark.parametrize("case", ["backend-int", "backend-unknown"])
def test_backend_argument(case):
    exc, backend = (TypeError, 3) if case == "backend-int" else (ValueError, "cuda-magic")
    with pytest.raises(exc, match="backend"):
        qkv.attention(Q, Q, Q, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_user_modifier_of_the_wrong_shape(backend):
    with pytest.raises(ValueError, match=r"from_fn.*shape"):
        qkv.attention(Q, Q, Q, score_mod=mods.from_fn(lambda s, b, h, q, k: s.sum(-1, keepdim=True)), backend=backend)


def test_tiled_on_meta_tensors_is_declined_with_the_reason():
    m = _x(1, 2, 4, 8).to("meta")
    with pytest.raises(ValueError, match="tiled.*meta"):
        qkv.attention(m, m, m, backend="tiled")


_BROKEN = ("rank", "dtype", "heads", "kv_len", "head_dim", "batch", "scale")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), G=st.integers(1, 3), Hkv=st.integers(1, 2), Nq=st.integers(1, 9), Nk=st.integers(1, 9),
       D=st.integers(1, 16), broken=st.sampled_from(_BROKEN), backend=st.sampled_from(BACKENDS))
def test_operator_malformed_calls_property(B, G, Hkv, Nq, Nk, D, broken, backend):
    """One broken property at a time on an otherwise valid call: refused with the argument named."""
    q, k, v = _x(B, G * Hkv, Nq, D), _x(B, Hkv, Nk, D), _x(B, Hkv, Nk, D)
    scale = None
    if broken == "rank":
        q, pattern = q[0], r"\bq\b.*rank 4"
    elif broken == "dtype":
        k, pattern = k.to(torch.int64), r"\bk\b.*dtype"
    elif broken == "heads":
        k, v = _x(B, 2 * Hkv, Nk, D), _x(B, 2 * Hkv, Nk, D)
        q, pattern = _x(B, 2 * Hkv * G + 1, Nq, D), r"heads"  # never a multiple of 2 * Hkv
    elif broken == "kv_len":
        v, pattern = _x(B, Hkv, Nk + 1, D), r"k and v.*length"
    elif broken == "head_dim":
        k, v, pattern = _x(B, Hkv, Nk, D + 1), _x(B, Hkv, Nk, D + 1), r"q and k.*head dim"
    elif broken == "batch":
        k, pattern = _x(B + 1, Hkv, Nk, D), r"batch"
    else:
        scale, pattern = float("inf"), r"scale"
    with pytest.raises((ValueError, TypeError), match=pattern):
        qkv.attention(q, k, v, scale=scale, backend=backend)


CONSTRUCTORS = {
    "bigbird-window-float": (lambda: M.bigbird(4, 3.0), TypeError, r"bigbird: window_blocks"),
    "bigbird-global-float": (lambda: M.bigbird(4, 3, 2.5), TypeError, r"bigbird: global_blocks"),
    "bigbird-window-even": (lambda: M.bigbird(4, 2), ValueError, r"bigbird: window_blocks"),
    "bigbird-block-zero": (lambda: M.bigbird(0), ValueError, r"bigbird: block"),
    "global-tokens-float": (lambda: M.global_tokens([1.7]), TypeError, r"global_tokens: indices"),
    "global-tokens-negative": (lambda: M.global_tokens([-1]), ValueError, r"global_tokens: indices"),
    "graph-edges-negative": (lambda: M.graph_from_edges(torch.tensor([[0, -1], [1, 2]]), 4), ValueError,
                             r"graph_from_edges: edge_index"),
    "graph-edges-too-big": (lambda: M.graph_from_edges(torch.tensor([[0, 4], [1, 2]]), 4), ValueError,
                            r"graph_from_edges: edge_index"),
    "graph-edges-float": (lambda: M.graph_from_edges(torch.tensor([[0.0], [1.0]]), 4), TypeError,
                          r"graph_from_edges: edge_index"),
    "graph-num-nodes": (lambda: M.graph_from_edges(torch.tensor([[0], [1]]), 0), ValueError, r"num_nodes"),
    "graph-not-square": (lambda: M.graph(torch.ones(3, 4, dtype=torch.bool)), ValueError, r"graph: adjacency"),
    "window-negative": (lambda: M.sliding_window(-1), ValueError, r"sliding_window: left"),
    "window-float": (lambda: M.sliding_window(2.5), TypeError, r"sliding_window: left"),
    "causal-align": (lambda: M.causal("top"), ValueError, r"causal: align"),
    "padding-negative": (lambda: M.padding([-1]), ValueError, r"padding\(kv_lengths\)"),
    "padding-float": (lambda: M.padding(torch.tensor([1.5])), TypeError, r"padding\(kv_lengths\)"),
    "padding-meta": (lambda: M.padding(torch.tensor([1], device="meta")), ValueError, r"padding\(kv_lengths\)"),
    "document-float": (lambda: M.document(torch.zeros(4)), TypeError, r"document\(ids\)"),
    "dense-float": (lambda: M.dense(torch.zeros(4, 4)), TypeError, r"dense\(mask\).*mods.bias"),
    "from-fn-not-callable": (lambda: M.from_fn(3), TypeError, r"from_fn"),
    "compose-non-mask": (lambda: M.causal() & 3, TypeError, r"mask &"),
    "cu-seqlens-decreasing": (lambda: M.document_from_cu_seqlens(torch.tensor([0, 3, 2])), ValueError,
                              r"cu_seqlens"),
    "strided-zero": (lambda: M.strided(0), ValueError, r"strided: stride"),
    "fixed-summary": (lambda: M.fixed(4, 5), ValueError, r"fixed: summary"),
    "bias-bool": (lambda: mods.bias(torch.ones(4, 4, dtype=torch.bool)), TypeError, r"bias.*masks.dense"),
    "alibi-int": (lambda: mods.alibi(torch.ones(2, dtype=torch.long)), TypeError, r"alibi: slopes"),
    "softcap-zero": (lambda: mods.softcap(0.0), ValueError, r"softcap: cap"),
    "softcap-nan": (lambda: mods.softcap(float("nan")), ValueError, r"softcap: cap"),
    "relative-bias-int-table": (lambda: mods.relative_bias(torch.zeros(4, 2, dtype=torch.long), lambda d: d),
                                TypeError, r"relative_bias: table"),
    "relative-bias-buckets-range": (lambda: mods.relative_bias(torch.zeros(4, 2),
                                                               torch.full((3, 3), 4, dtype=torch.long)),
                                    ValueError, r"relative_bias: precomputed buckets"),
    "mods-from-fn-not-callable": (lambda: mods.from_fn("x"), TypeError, r"from_fn"),
    # issue 29
    "from-fn-align": (lambda: M.from_fn(lambda b, h, q, k: k <= q, align="top"), ValueError, r"from_fn: align"),
    "block-map-head-reader-without-h": (lambda: M.from_fn(lambda b, h, q, k: k <= h).block_map(8, 8, 4, 4),
                                        ValueError, r"block_map.*H="),
    "sparsity-head-reader-without-h": (lambda: M.from_fn(lambda b, h, q, k: k <= h).sparsity(8, 8), ValueError,
                                       r"sparsity.*H="),
    "block-map-h-zero": (lambda: M.causal().block_map(8, 8, 4, 4, H=0), ValueError, r"block_map: H"),
    "cu-seqlens-float-lengths": (lambda: qkv.varlen.cu_seqlens_from_lengths([1.5, 2]), TypeError,
                                 r"cu_seqlens_from_lengths: lengths"),
    "cu-seqlens-float-tensor": (lambda: qkv.varlen.cu_seqlens_from_lengths(torch.tensor([2.0, 3.0])), TypeError,
                                r"cu_seqlens_from_lengths: lengths"),
    "cu-seqlens-int32-wrap": (lambda: qkv.varlen.cu_seqlens_from_lengths([2 ** 31 - 1, 1]), ValueError,
                              r"cu_seqlens_from_lengths.*int32"),
    "kivi-bits-float": (lambda: KIVI(bits=4.0), ValueError, r"KIVI\(bits\)"),
    "merge-states-stacked-tensor": (lambda: qkv.merge_states(torch.zeros(2, 1, 1, 3, 4), torch.zeros(2, 1, 1, 3)),
                                    TypeError, r"merge_states: outs.*list"),
    "merge-states-float-lse": (lambda: qkv.merge_states([torch.zeros(1, 1, 3, 4)], [0.0]), TypeError,
                               r"merge_states: lses\[0\]"),
    "merge-states-none-lse": (lambda: qkv.merge_states([torch.zeros(1, 1, 3, 4)], [None]), TypeError,
                              r"merge_states: lses\[0\]"),
    "merge-states-int-out": (lambda: qkv.merge_states([torch.zeros(1, 1, 3, 4, dtype=torch.long)],
                                                      [torch.zeros(1, 1, 3)]), TypeError, r"merge_states: outs\[0\]"),
}


@pytest.mark.parametrize("case", list(CONSTRUCTORS))
def test_constructor_bad_input(case):
    make, exc, pattern = CONSTRUCTORS[case]
    with pytest.raises(exc, match=pattern):
        make()


@pytest.mark.parametrize("case", ["dense", "padding", "document", "prefix_lm", "positions"])
def test_masks_keep_no_reference_to_the_callers_tensor(case):
    t = {"dense": torch.ones(4, 4, dtype=torch.bool), "padding": torch.tensor([3]),
         "document": torch.tensor([0, 0, 1, 1]), "prefix_lm": torch.tensor([2]),
         "positions": torch.arange(4)}[case]
    m = {"dense": M.dense, "padding": M.padding, "document": M.document, "prefix_lm": M.prefix_lm,
         "positions": lambda p: M.positions(p, p)}[case](t)
    before = m.materialize(1, 1, 4, 4).clone()
    t.zero_()
    assert torch.equal(m.materialize(1, 1, 4, 4), before)


CACHES = {
    "dynamic": lambda: KVCache([FullSpec(2, 8), SlidingWindowSpec(4, 2, 8)], storage=Dynamic()),
    "static": lambda: KVCache([FullSpec(2, 8), SlidingWindowSpec(4, 2, 8)], storage=Static(16)),
    "paged": lambda: KVCache([FullSpec(2, 8), SlidingWindowSpec(4, 2, 8)], storage=Paged(4, 32)),
    "kivi": lambda: KVCache([FullSpec(2, 8), FullSpec(2, 8)], quant=KIVI(bits=4, group_size=4, residual=4)),
}


def _kv(n, B=1, H=2, D=8):
    return torch.randn(B, H, n, D), torch.randn(B, H, n, D)


def _write(cache, pos):
    p = torch.tensor([pos])
    cache.prepare(torch.zeros_like(p), p)
    return [cache.update(layer, *_kv(len(pos)), positions=p) for layer in (0, 1)]


CACHE_CALLS = {
    "k-rank3": (lambda c: c.update(0, torch.randn(2, 3, 8), torch.randn(2, 3, 8), positions=torch.tensor([[4]])),
                ValueError, r"update: k"),
    "k-heads": (lambda c: c.update(0, *_kv(1, H=3), positions=torch.tensor([[4]])), ValueError, r"update: k"),
    "kv-disagree": (lambda c: c.update(0, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 2, 8),
                                       positions=torch.tensor([[4]])), ValueError, r"update: k .* and v"),
    "batch-changes": (lambda c: c.update(0, *_kv(1, B=2), positions=torch.tensor([[4], [4]])), ValueError,
                      r"batch"),
    "position-repeats": (lambda c: c.update(0, *_kv(1), positions=torch.tensor([[3]])), ValueError,
                         r"positions must increase"),
    "position-backwards": (lambda c: c.update(0, *_kv(2), positions=torch.tensor([[5, 4]])), ValueError,
                           r"positions must increase"),
    "positions-shape": (lambda c: c.update(0, *_kv(2), positions=torch.tensor([[4]])), ValueError, r"positions"),
    "layer-out-of-range": (lambda c: c.update(7, *_kv(1), positions=torch.tensor([[4]])), ValueError,
                           r"layer_idx 7 out of range.*KVCache\(model\)"),
    "retried-step": (lambda c: c.update(0, *_kv(4), positions=torch.tensor([[0, 1, 2, 3]])), ValueError,
                     r"layer 0 already stored this step"),
    "fork-negative": (lambda c: c.fork(-1), ValueError, r"fork\(n\): expected an int >= 1"),
    "fork-zero": (lambda c: c.fork(0), ValueError, r"fork\(n\).*cache.reset\(\)"),
    "fork-float": (lambda c: c.fork(2.0), ValueError, r"fork\(n\)"),
    "crop-too-far": (lambda c: c.crop(99), ValueError, r"crop\(99\)"),
    "crop-float": (lambda c: c.crop(1.5), TypeError, r"crop\(length\)"),
    "reorder-out-of-range": (lambda c: c.reorder(torch.tensor([3])), ValueError, r"reorder\(beam_idx\)"),
    "reorder-float": (lambda c: c.reorder(torch.tensor([0.0])), TypeError, r"reorder\(beam_idx\)"),
}


@pytest.mark.parametrize("storage", list(CACHES))
@pytest.mark.parametrize("case", list(CACHE_CALLS))
def test_cache_refuses_and_changes_nothing(case, storage):
    call, exc, pattern = CACHE_CALLS[case]
    cache = CACHES[storage]()
    _write(cache, [0, 1, 2, 3])
    twin = copy.deepcopy(cache)
    with pytest.raises(exc, match=pattern):
        call(cache)
    assert cache.seq_length == twin.seq_length
    torch.manual_seed(5)
    after = _write(cache, [4])
    torch.manual_seed(5)
    expected = _write(twin, [4])
    for a, b in zip(after, expected, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.kv_positions, b.kv_positions)


@pytest.fixture(scope="module")
def tiny_lm():
    from qkv.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48)).eval()


GENERATE = {
    "pad-outside-vocab": (dict(pad_token_id=50), ValueError, r"pad_token_id"),
    "pad-negative": (dict(pad_token_id=-1), ValueError, r"pad_token_id"),
    "pad-float": (dict(pad_token_id=1.0), ValueError, r"pad_token_id"),
    "ids-outside-vocab": (dict(input_ids=torch.tensor([[1, 50]])), ValueError, r"input_ids.*vocabulary"),
    "ids-negative": (dict(input_ids=torch.tensor([[-3, 2]])), ValueError, r"input_ids"),
    "ids-float": (dict(input_ids=torch.tensor([[1.0, 2.0]])), ValueError, r"input_ids"),
    "temperature-nan": (dict(do_sample=True, temperature=float("nan")), ValueError, r"temperature"),
    "temperature-zero": (dict(do_sample=True, temperature=0.0), ValueError, r"temperature"),
    "top-p-nan": (dict(do_sample=True, top_p=float("nan")), ValueError, r"top_p"),
    "top-k-zero": (dict(do_sample=True, top_k=0), ValueError, r"top_k"),
    "max-new-negative": (dict(max_new_tokens=-1), ValueError, r"max_new_tokens"),
    "chunk-zero": (dict(prefill_chunk_size=0), ValueError, r"prefill_chunk_size"),
    "mask-shape": (dict(attention_mask=torch.ones(1, 5)), ValueError, r"attention_mask"),
    "mask-right-padded": (dict(attention_mask=torch.tensor([[1, 0]])), ValueError, r"attention_mask"),
    "eos-str": (dict(eos_token_id="2"), TypeError, r"eos_token_id"),
}


@pytest.mark.parametrize("case", list(GENERATE))
def test_generate_refuses_up_front_and_leaves_the_cache_empty(tiny_lm, case):
    from qkv.models.generate import generate

    over, exc, pattern = GENERATE[case]
    kw = dict(input_ids=torch.tensor([[1, 2]]), max_new_tokens=3, cache=KVCache(tiny_lm.cache_specs()))
    kw.update(over)
    with pytest.raises(exc, match=pattern):
        generate(tiny_lm, kw.pop("input_ids"), **kw)
    assert kw["cache"].seq_length == 0, "a refused generate wrote to the cache"


@pytest.mark.parametrize("factory", ["tensor", "cache-object", "none"])
def test_verify_cache_needs_a_factory(tiny_lm, factory):
    from qkv.models.verify import verify_cache

    arg = {"tensor": torch.zeros(3), "cache-object": KVCache(tiny_lm.cache_specs()), "none": None}[factory]
    with pytest.raises(TypeError, match="cache_factory"):
        verify_cache(tiny_lm, arg)


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _edit_config(path: Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


_DROP = object()


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _safetensors_file(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def _second_shard(path: Path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(_safetensors_file(path)))
    name = next(iter(state))
    save_file({name: state[name].contiguous()}, str(path / "extra.safetensors"))


def _int_weights(path: Path):
    from safetensors.torch import load_file, save_file

    f = _safetensors_file(path)
    state = load_file(str(f))
    name = next(n for n in state if n.endswith("proj.weight"))
    state[name] = state[name].to(torch.int32)
    save_file(state, str(f))


FROM_HF = {
    "config-not-json": (lambda p: (p / "config.json").write_text("{not json"), {}, ValueError,
                        r"config.json is not valid JSON"),
    "config-empty": (lambda p: (p / "config.json").write_text(""), {}, ValueError, r"config.json is empty"),
    "config-not-utf8": (lambda p: (p / "config.json").write_bytes(b'{"a": "\xff\xfe"}'), {}, ValueError,
                        r"config.json is not UTF-8"),
    "config-list": (lambda p: (p / "config.json").write_text("[1, 2]"), {}, ValueError, r"config.json holds a JSON"),
    "no-num-hidden-layers": (lambda p: _edit_config(p, num_hidden_layers=_DROP), {}, ValueError,
                             r"num_hidden_layers"),
    "heads-zero": (lambda p: _edit_config(p, num_attention_heads=0), {}, ValueError, r"num_attention_heads"),
    "negative-eps": (lambda p: _edit_config(p, rms_norm_eps=-1e-6), {}, ValueError, r"epsilon"),
    "unknown-model-type": (lambda p: _edit_config(p, model_type="wat"), {}, ValueError, r"model_type"),
    "broken-shard": (lambda p: _safetensors_file(p).write_bytes(b"\x00" * 8), {}, ValueError,
                     r"safetensors shard .*model.safetensors"),
    "tensor-in-two-shards": (_second_shard, {}, ValueError, r"two shards"),
    "int32-weights": (_int_weights, {}, ValueError, r"non-float weights.*int32"),
    "fifo-shard": (lambda p: os.mkfifo(p / "zz-pipe.safetensors"), {}, ValueError, r"zz-pipe.safetensors is not a "
                   r"regular file"),
    "layers-beyond-weights": (lambda p: _edit_config(p, num_hidden_layers=3), {}, ValueError,
                              r"does not fit.*missing tensors"),
    "hidden-beyond-weights": (lambda p: _edit_config(p, hidden_size=64), {}, ValueError, r"does not fit.*shape"),
    "dtype-unknown": (lambda p: None, {"dtype": "bf17"}, ValueError, r"dtype 'bf17'.*bf16"),
    "dtype-int": (lambda p: None, {"dtype": torch.int8}, ValueError, r"dtype"),
}


@pytest.mark.parametrize("case", list(FROM_HF))
def test_from_hf_bad_checkpoint_names_the_file_and_changes_nothing(checkpoint, tmp_path, case):
    from qkv.models import from_hf

    break_it, kw, exc, pattern = FROM_HF[case]
    path = _copy_checkpoint(checkpoint, tmp_path / "ckpt")
    break_it(path)
    before = _digest(path)
    with pytest.raises(exc, match=pattern):
        from_hf(path, **kw)
    assert _digest(path) == before


@pytest.mark.parametrize("name", ["bf16", "float16", "torch.float64"])
def test_from_hf_accepts_common_dtype_names(checkpoint, name):
    from qkv.models import from_hf
    from qkv.models.loading import DTYPE_NAMES

    model = from_hf(checkpoint, dtype=name)
    assert next(model.parameters()).dtype == DTYPE_NAMES[name.removeprefix("torch.")]


def test_from_hf_refuses_an_object_that_only_looks_like_a_transformers_model():
    """A module with ``config`` and ``state_dict`` that is not a ``transformers.PreTrainedModel`` is refused by type,
    not read as a checkpoint."""
    pytest.importorskip("transformers")
    from qkv.models import from_hf

    lookalike = torch.nn.Linear(2, 2)
    lookalike.config = {"model_type": "llama"}
    with pytest.raises(TypeError, match="a transformers PreTrainedModel, got Linear"):
        from_hf(lookalike)


def _cli(*args):
    from typer.testing import CliRunner

    from qkv.cli import _register, app

    _register()
    return CliRunner().invoke(app, list(args))


CLI_CONFIGS = {
    "list": ("[1, 2]", r"holds a JSON list"),
    "heads-zero": ('{"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 64}', r"num_attention_heads"),
    "layer-types-int": ('{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "layer_types": 5}',
                        r"layer_types"),
    "text-config-int": ('{"text_config": 3}', r"text_config"),
    "not-json": ("{", r"not valid JSON"),
    "empty": ("", r"empty"),
    "missing-layers": ('{"num_attention_heads": 4}', r"num_hidden_layers"),
}


@pytest.mark.parametrize("command", ["memory", "flops", "compare"])
@pytest.mark.parametrize("case", list(CLI_CONFIGS))
def test_cli_bad_config_is_one_line_and_exit_2(tmp_path, case, command):
    text, pattern = CLI_CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_text(text)
    before = path.read_bytes()
    r = _cli(command, str(path))
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(path) in r.stderr or "HF config" in r.stderr, r.stderr
    assert __import__("re").search(pattern, r.stderr), r.stderr
    assert path.read_bytes() == before


@pytest.mark.parametrize("what", ["dev-zero", "fifo", "directory-without-config"])
def test_cli_reads_only_regular_files(tmp_path, what):
    if what == "dev-zero":
        target = "/dev/zero"
    elif what == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs on this platform")
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    else:
        target = str(tmp_path)
    r = _cli("memory", target)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("context", ["99999999999999999999999M", "1e30", "0", "-5", "1.5.3", "2199023255553"])
def test_cli_context_one_rule(context):
    r = _cli("memory", "llama-3-8b", "--context", context)
    assert r.exit_code == 2 and "context length" in r.stderr, r.output
