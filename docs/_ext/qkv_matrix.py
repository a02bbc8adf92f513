"""The capability matrices of the docs site, generated from the code and checked against it.

``backend_matrix`` asks every registered backend about one tiny request per feature (``qkv.explain``, which runs
each backend's own ``decline`` rule); ``verify_backend_matrix`` then makes the call each cell describes with
``backend=<name>``: a declined cell must raise, an accepted one must run and agree with the float64 reference
backend (outputs, lse and gradients). ``family_matrix`` reads the family registry (``qkv.models.FAMILIES``) and
tries each feature on a tiny random model of each HF ``model_type``. The site's matrices page runs all of them at
build time, so a matrix that disagrees with the code fails ``make docs``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import qkv
from qkv import masks, mods

__all__ = ["Case", "FEATURES", "DEVICES", "NOT_RUN", "MatrixMismatch", "backend_matrix", "verify_backend_matrix",
           "markdown_table", "EXPLAIN_FAILURES", "KNOWN_DISAGREEMENTS", "FAMILY_FEATURES", "family_matrix"]

#: Backends whose accepted cells are not run here, and why (the decline rules are still checked for them).
NOT_RUN = {"flex": "compiles one kernel per shape (5-40 s each on CPU); tests/backends/test_flex.py runs it"}


class MatrixMismatch(AssertionError):
    """A matrix cell and the code disagree."""


@dataclass
class Case:
    """One feature, as the keyword arguments of one tiny ``qkv.attention`` call."""

    name: str
    group: str
    build: Callable[[torch.Generator, str], dict]
    call: str = "attention"  # "varlen": qkv.varlen_attention on the packed form of the same request; "paged": the
    # keys and values in a block pool read through block tables (qkv.PagedKV), the causal positions mask
    #: devices the request cannot be built on (a top-k mask holds index values: none on meta)
    skip_on: set = field(default_factory=set)


def _qkv(gen, device, *, dtype=torch.float32, hq=4, hkv=4, n=12, dqk=8, dv=8, grad=False):
    def draw(*shape):
        t = torch.randn(*shape, generator=gen).to(dtype)
        t = t.to(device) if device != "meta" else torch.empty(*shape, dtype=dtype, device="meta")
        return t.requires_grad_(grad)

    return {"q": draw(1, hq, n, dqk), "k": draw(1, hkv, n, dqk), "v": draw(1, hkv, n, dv)}


def _with(**kw):
    shape_keys = ("dtype", "hq", "hkv", "n", "dqk", "dv", "grad")

    def build(gen, device):
        out = _qkv(gen, device, **{k: v for k, v in kw.items() if k in shape_keys})
        for k, v in kw.items():
            if k not in shape_keys:  # a plain function builds a value from the seeded generator
                out[k] = v(gen, device) if type(v).__name__ == "function" else v
        return out

    return build


_IDX = torch.tensor([[[[0, 3, 5], [1, 2, -1], [4, 4, 0], [7, 8, 9]] * 3]])  # (1, 1, 12, 3) listed keys

FEATURES: list[Case] = [
    Case("no mask", "masks", _with()),
    Case("causal (bottom-right)", "masks", _with(mask=masks.causal())),
    Case("causal (top-left), Nq < Nk", "masks", _with(mask=masks.causal(align="top_left"))),
    Case("sliding window", "masks", _with(mask=masks.sliding_window(3))),
    Case("padding (key lengths)", "masks", _with(mask=masks.padding(torch.tensor([7])))),
    Case("document (packed ids)", "masks", _with(mask=masks.document(torch.tensor([0] * 5 + [1] * 7)))),
    Case("user mask function", "masks", _with(mask=masks.from_fn(lambda b, h, q, k: (q - k) % 2 == 0))),
    Case("top-k key lists", "masks", _with(mask=lambda g, d: masks.topk(_IDX.to(d))), skip_on={"meta"}),
    Case("ALiBi", "score mods", _with(score_mod=mods.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625])))),
    Case("softcap", "score mods", _with(score_mod=mods.softcap(5.0))),
    Case("tensor bias", "score mods", _with(score_mod=lambda g, d: mods.bias(torch.randn(1, 4, 12, 12, generator=g)))),
    Case("user score function", "score mods",
         _with(score_mod=mods.from_fn(lambda s, b, h, q, k: s - 0.1 * (q - k).abs()))),
    Case("sinks", "options", _with(sinks=lambda g, d: torch.randn(4, generator=g))),
    Case("dropout (seeded)", "options", _with(dropout_p=0.2, generator=lambda g, d: torch.Generator().manual_seed(7))),
    Case("backward", "options", _with(grad=True, mask=masks.causal())),
    Case("return_lse", "options", _with(return_lse=True, mask=masks.causal())),
    Case("batch_invariant", "options", _with(batch_invariant=True)),
    Case("GQA (Hq=4, Hkv=2)", "shapes", _with(hkv=2)),
    Case("Dv != Dqk", "shapes", _with(dv=16)),
    Case("varlen (cu_seqlens)", "shapes", _with(), call="varlen"),
    Case("paged KV (block tables)", "shapes", _with(), call="paged", skip_on={"meta"}),
    Case("float64", "dtypes", _with(dtype=torch.float64)),
    Case("float32", "dtypes", _with(dtype=torch.float32)),
    Case("bfloat16", "dtypes", _with(dtype=torch.bfloat16)),
    Case("float16", "dtypes", _with(dtype=torch.float16)),
]

#: The devices asked on this machine (CUDA joins when the build runs on a GPU).
DEVICES = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])

_CU = torch.tensor([0, 5, 12])


def _request(case: Case, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    kw = case.build(gen, device)
    if case.name.startswith("causal (top-left)"):
        kw["q"] = kw["q"][:, :, :5].detach().requires_grad_(kw["q"].requires_grad)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].to(kw["q"].device)
    return kw


#: The paged case's pool: blocks of _BLOCK slots, the request's 12 keys in blocks 2, 0, 1 of a 4-block pool.
_BLOCK, _TABLE = 4, torch.tensor([[2, 0, 1]])


def _paged(kw: dict) -> dict:
    """The request with its keys and values moved into a shuffled block pool, read through ``qkv.PagedKV`` (every
    query at its own position over the keys at positions 0..11, causal)."""
    kw = dict(kw)
    k, v = kw.pop("k"), kw.pop("v")
    n = k.shape[2]
    pools = []
    for t in (k, v):
        pool = t.new_zeros(4, t.shape[1], _BLOCK, t.shape[3])  # (P, Hkv, T, D)
        for j in range(n):
            pool[_TABLE[0, j // _BLOCK], :, j % _BLOCK] = t[0, :, j]
        pools.append(pool)
    pos = torch.arange(n)[None]
    kw["k"], kw["v"] = pools
    kw["paged"] = qkv.PagedKV(_TABLE, pos, pos[:, -kw["q"].shape[2]:], None)
    return kw


def _explain_kwargs(case: Case, kw: dict) -> dict:
    """The ``qkv.attention`` keywords of the request (varlen: the dense form of the packed call; paged: the block
    pool and its tables)."""
    kw = dict(kw)
    if case.call == "varlen":
        kw["mask"] = qkv.varlen.varlen_mask(_CU, _CU)
    if case.call == "paged":
        kw = _paged(kw)
    return kw


def backend_matrix(device: str = "cpu") -> dict[tuple[str, str], str | None]:
    """``{(feature, backend): None if accepted else the backend's reason}``, from ``qkv.explain``."""
    out = {}
    for case in FEATURES:
        if device in case.skip_on:
            continue
        kw = _explain_kwargs(case, _request(case, device))
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
        try:
            declined = qkv.explain(q, k, v, **kw).declined
        except ValueError as e:  # no backend at all can run it (batch_invariant on meta tensors): explain says so
            EXPLAIN_FAILURES[(case.name, device)] = f"{type(e).__name__}: {e}"
            declined = {name: _named_call_error(q, k, v, kw, name) for name in qkv.backends.names()}
        for name in qkv.backends.names():
            out[(case.name, name)] = declined.get(name)
    return out


#: Requests ``qkv.explain`` failed on, with its error; their cells are what a call naming each backend says.
EXPLAIN_FAILURES: dict[tuple[str, str], str] = {}


def _named_call_error(q, k, v, kw: dict, name: str) -> str | None:
    try:
        qkv.attention(q, k, v, backend=name, **kw)
    except ValueError as e:
        return str(e).partition("cannot run this request: ")[2] or str(e)
    return None


def _run(case: Case, kw: dict, backend: str):
    kw = dict(kw)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    if case.call == "varlen":
        pack = (lambda t: t[0].transpose(0, 1))  # (1, H, N, D) -> (N, H, D): two sequences of 5 and 7
        out = qkv.varlen_attention(pack(q), pack(k), pack(v), _CU, _CU, backend=backend, **kw)
        return out.transpose(0, 1).unsqueeze(0), None
    if case.call == "paged":
        kw = _paged({"q": q, "k": k, "v": v, **kw})
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    res = qkv.attention(q, k, v, backend=backend, **kw)
    return (res.out, res.lse) if kw.get("return_lse") else (res, None)


def _oracle(case: Case, kw: dict):
    """The float64 reference of the request: the reference backend on the same call, or for a paged request on the
    dense keys and values under the causal positions mask its block tables stand for."""
    if case.call != "paged":
        return _run(case, kw, "reference")
    pos = torch.arange(kw["k"].shape[2])[None]
    mask = masks.positions(pos[:, -kw["q"].shape[2]:], pos, causal=True)
    return qkv.attention(kw["q"], kw["k"], kw["v"], mask=mask, backend="reference"), None


def _as64(kw: dict) -> dict:
    out = {}
    for key, val in kw.items():
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            val = val.detach().to(torch.float64).requires_grad_(val.requires_grad)
        out[key] = val
    return out


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]


#: Cells where the code is known to contradict its own decline rule, each with what happens. The check treats
#: them as strict expected failures: one that starts agreeing fails the build too, so the entry gets removed.
KNOWN_DISAGREEMENTS: dict[tuple[str, str, str], str] = {}


def verify_backend_matrix(matrix: dict[tuple[str, str], str | None], device: str = "cpu") -> dict[str, int]:
    """Make every cell's call. Raises :class:`MatrixMismatch` naming every cell where the code disagrees with the
    matrix (other than :data:`KNOWN_DISAGREEMENTS`, which must still disagree); returns counts of the cells."""
    counts = {"accepted and agreeing with the float64 reference": 0, "declined and raising": 0,
              "accepted, not run here": 0, "known disagreements": 0}
    cases = {c.name: c for c in FEATURES}
    problems = []
    for (feature, backend), reason in matrix.items():
        problem = _check_cell(cases[feature], backend, reason, device, counts)
        known = (feature, backend, device) in KNOWN_DISAGREEMENTS
        if problem is not None and known:
            counts["known disagreements"] += 1
        elif problem is not None:
            problems.append(f"{feature!r} x {backend!r} on {device}: {problem}")
        elif known:
            problems.append(f"{feature!r} x {backend!r} on {device}: listed in KNOWN_DISAGREEMENTS but now agrees "
                            "with the matrix; remove the entry")
    stale = [key for key in KNOWN_DISAGREEMENTS if key[2] == device and (key[0], key[1]) not in matrix]
    problems += [f"{key}: listed in KNOWN_DISAGREEMENTS but no longer in the matrix" for key in stale]
    if problems:
        raise MatrixMismatch("the backend matrix and the code disagree:\n" + "\n".join(problems))
    return counts


def _check_cell(case: Case, backend: str, reason: str | None, device: str, counts: dict) -> str | None:
    kw = _request(case, device)
    if reason is not None:
        try:
            _run(case, kw, backend)
        except (ValueError, TypeError):
            counts["declined and raising"] += 1
            return None
        return f"the matrix says declined ({reason}) but backend={backend!r} ran it"
    if backend in NOT_RUN:
        counts["accepted, not run here"] += 1
        return None
    try:
        out, lse = _run(case, kw, backend)
    except Exception as e:  # noqa: BLE001 (any failure of an accepted cell is a disagreement)
        return f"the matrix says accepted but the call raised {e!r}"
    if device == "meta":
        if out.shape[:-1] != kw["q"].shape[:-1]:
            return f"output shape {tuple(out.shape)}"
        counts["accepted and agreeing with the float64 reference"] += 1
        return None
    ref_kw = _as64(_request(case, device))  # fresh: the call above advanced the dropout generator
    ref, ref_lse = _oracle(case, ref_kw)
    tol = _tolerance(kw["q"].dtype) * max(1.0, float(ref.detach().abs().max()))
    err = float((out.detach().double() - ref.detach()).abs().max()) if out.numel() else 0.0
    bad = [f"out error {err:.3g} > {tol:.3g}"] if not err <= tol else []
    if lse is not None:
        lse_err = float((lse.double() - ref_lse).abs().max())
        bad += [f"lse error {lse_err:.3g}"] if not lse_err <= tol else []
    if kw["q"].requires_grad:
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        got = torch.autograd.grad(out, kw["q"], g.to(out.dtype))[0].double()
        want = torch.autograd.grad(ref, ref_kw["q"], g)[0]
        grad_err = float((got - want).abs().max())
        bad += [f"dq error {grad_err:.3g}"] if not grad_err <= 10 * tol else []
    if bad:
        return "accepted but disagrees with the float64 reference: " + "; ".join(bad)
    counts["accepted and agreeing with the float64 reference"] += 1
    return None


def markdown_table(matrix: dict[tuple[str, str], str | None], corner: str = "") -> str:
    """The matrix as a Markdown table: a check mark where accepted, otherwise a numbered reason listed below."""
    rows = list(dict.fromkeys(r for r, _ in matrix))
    cols = list(dict.fromkeys(c for _, c in matrix))
    reasons: dict[str, int] = {}

    def cell(r, c):
        if (r, c) not in matrix:
            return "n/a"
        why = matrix[(r, c)]
        if why is None:
            return "✓"
        n = reasons.setdefault(why.replace("|", "/"), len(reasons) + 1)
        return f"✗ ({n})"

    lines = [f"| {corner} | " + " | ".join(f"`{c}`" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += ["| " + r + " | " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    lines += ["", "Reasons, as the code gives them:", ""]
    lines += [f"{n}. {why}" for why, n in reasons.items()]
    return "\n".join(lines)


_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            num_key_value_heads=4)
_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1)
_HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2, linear_num_key_heads=2,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=2)

#: Per HF ``model_type``: the config fields of a tiny model (on top of ``_COMMON``). A registered family without
#: an entry here fails the matrices page, so a new family cannot be left out of the table.
TINY: dict[str, dict] = {
    "llama": {}, "mistral": {"sliding_window": 8}, "qwen2": {}, "qwen3": {}, "olmo2": {}, "olmo3": {},
    "gemma2": {"sliding_window": 8}, "gemma3_text": {"sliding_window": 8},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v2": {**_MLA, **_MOE, "topk_method": "greedy"},
    "deepseek_v3": {**_MLA, **_MOE},
    "deepseek_v32": {**_MLA, **_MOE, "q_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4},
    "qwen3_next": {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16},
    "qwen3_5_text": {**_HYBRID}, "qwen3_5_moe_text": {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 16,
                                                     "shared_expert_intermediate_size": 16},
    "kimi_linear": {**_MLA, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 2,
                                           "kda_layers": [1], "full_attn_layers": [2]}},
    "gpt2": {}, "bloom": {}, "bert": {}, "t5": {"d_kv": 8, "d_ff": 48, "num_decoder_layers": 2},
    "smollm3": {"num_hidden_layers": 4},
    "olmo_hybrid": {**_HYBRID, "num_hidden_layers": 2},
    "mistral4": {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_key_value_heads": 4,
                 "head_dim": 24,  # qk_nope_head_dim + qk_rope_head_dim, as Mistral4Config sets it
                 "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                 "q_lora_rank": 24, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                 "n_shared_experts": 1, "first_k_dense_replace": 1,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.0,
                                     "partial_rotary_factor": 8 / 24}},
    "gemma4_text": {"num_hidden_layers": 4, "sliding_window": 4, "global_head_dim": 16, "num_kv_shared_layers": 1,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 64},
    "glm_moe_dsa": {**_MLA, **_MOE, "q_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4},
    "deepseek_v4": {"num_hidden_layers": 3, "q_lora_rank": 12, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2,
                    "index_head_dim": 8, "index_topk": 2, "sliding_window": 4, "partial_rotary_factor": 0.5,
                    "num_key_value_heads": 1, "hc_mult": 2, "num_hash_layers": 1,
                    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention"]},
    "minimax_m3_vl_text": {"num_hidden_layers": 2, "dense_intermediate_size": 24, "shared_intermediate_size": 16,
                           "num_local_experts": 4, "num_experts_per_tok": 2, "index_n_heads": 2,
                           "index_head_dim": 8, "index_block_size": 2, "index_topk_blocks": 2,
                           "index_local_blocks": 1, "layer_types": ["full_attention", "minimax_m3_sparse"],
                           "mlp_layer_types": ["dense", "sparse"]},
    "qwen4_exp_text": {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                       "shared_expert_intermediate_size": 16, "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1],
                       "ple_embed_dim": 8, "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 50,
                       "make_ngram_vocab_size_divisible_by": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                       "indexer_head_dim": 8, "indexer_budget": 4, "indexer_compress_ratio": 2,
                       "layer_types": ["linear_attention", "indexed_attention"]},
}
#: Registered types that wrap another one (a multimodal checkpoint's language model): tried through that one.
WRAPS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text",
         "minimax_m3_vl": "minimax_m3_vl_text", "qwen4_exp": "qwen4_exp_text"}


def registered_families() -> list[str]:
    """Every HF ``model_type`` ``from_hf`` builds, read from the family registry."""
    import pkgutil

    import qkv.models

    for info in pkgutil.iter_modules(qkv.models.__path__):  # each family module registers itself on import
        if info.name.startswith("family_"):
            importlib.import_module(f"qkv.models.{info.name}")
    return sorted(qkv.models.FAMILIES)


def tiny_hf_model(model_type: str, seed: int = 0):
    """A tiny HF model of ``model_type`` with random weights (eager attention), in eval mode."""
    import transformers

    if model_type not in TINY:
        raise MatrixMismatch(f"model_type {model_type!r} is registered in qkv.models.FAMILIES but has no tiny "
                             "config in docs/_ext/qkv_matrix.py TINY: add one so the family matrix covers it")
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **TINY[model_type]})
    auto = transformers.AutoModelForCausalLM
    if model_type == "bert":
        auto = transformers.AutoModel
    elif model_type == "t5":
        auto = transformers.AutoModelForSeq2SeqLM
    elif model_type == "mistral4":  # transformers 5.25's auto mapping does not list it
        return transformers.Mistral4ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    return auto.from_config(cfg, attn_implementation="eager").eval()


def _greedy(model, ids, cache=None):
    from qkv.models import generate

    return generate(model, ids, max_new_tokens=4, cache=cache).new_tokens


def _result(out) -> torch.Tensor:
    """Logits for a language model, the last hidden states for an encoder."""
    for name in ("logits", "last_hidden_state"):
        if hasattr(out, name):
            return getattr(out, name)
    return out


def _forward(model, ids, *, hf: bool):
    """One forward pass; an encoder-decoder (T5) reads ``ids`` as both its inputs and its decoder inputs."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) or type(model).__name__ == "T5":
        return _result(model(input_ids=ids, decoder_input_ids=ids) if hf else model(ids, ids))
    return _result(model(ids))


def _close(got, want, what: str, rel: float = 1e-3) -> None:
    err = float((got.double() - want.double()).abs().max())
    if not err < rel * max(1.0, float(want.abs().max())):
        raise AssertionError(f"{what}: max difference {err:.3g}")


def _try_from_hf(hf, state):
    from qkv.models import from_hf

    state["model"] = from_hf(hf)
    state["ids"] = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    _close(_forward(state["model"], state["ids"], hf=False), _forward(hf, state["ids"], hf=True),
           "qkv against HF eager")


def _try_hf_route(hf, state):
    import copy

    import qkv.integrations.transformers as qkv_hf

    routed = copy.deepcopy(hf)
    routed.config = copy.deepcopy(hf.config)
    qkv_hf.use(routed)
    _close(_forward(routed, state["ids"], hf=True), _forward(hf, state["ids"], hf=True),
           "attn_implementation='qkv' against eager")


def _try_cache(make_cache):
    def run(hf, state):
        from qkv.cache import KVCache

        model, ids = state["model"], state["ids"]
        want = _greedy(model, ids)
        got = _greedy(model, ids, KVCache(model.cache_specs(), **make_cache()))
        if "exact" in make_cache.__name__ and not torch.equal(got, want):
            raise AssertionError(f"tokens {got.tolist()} where the default cache gives {want.tolist()}")

    return run


def _paged_exact():
    from qkv.cache import Paged

    return {"storage": Paged(block_size=4, num_blocks=32)}


def _kivi():
    from qkv.cache import KIVI

    return {"quant": KIVI(bits=4, group_size=4, residual=4)}


def _try_engine(hf, state):
    from qkv.models import Engine

    model, ids = state["model"], state["ids"]
    engine = Engine(model, num_blocks=32, block_size=4, max_batch=2, optimize=False)
    rid = engine.add(ids[0].tolist(), max_new_tokens=4)
    got = engine.run()[rid].tokens
    want = _greedy(model, ids)[0].tolist()
    if list(got) != want:
        raise AssertionError(f"Engine tokens {list(got)} where generate gives {want}")


def _try_context_parallel(hf, state):
    import torch.distributed as dist

    import qkv.distributed as cp

    if not dist.is_initialized():  # one process is a group of one: the schemes' bookkeeping still runs
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    model, ids = state["model"], state["ids"]
    ctx = cp.context_parallel(model, scheme="ring")
    _close(_result(ctx(ctx.shard(ids))), _forward(model, ids, hf=False), "context parallel against one process")


#: Feature name -> how it is tried on a family's tiny model (each after ``from_hf``, which the others reuse).
FAMILY_FEATURES: dict[str, Callable] = {
    "from_hf (logits = HF eager)": _try_from_hf,
    "HF route (attn_implementation='qkv')": _try_hf_route,
    "paged cache": _try_cache(_paged_exact),
    "KIVI cache": _try_cache(_kivi),
    "Engine": _try_engine,
    "context parallel": _try_context_parallel,
}


def family_matrix(model_types: list[str] | None = None) -> dict[tuple[str, str], str | None]:
    """``{(model_type, feature): None if it works else what happened}``, every feature tried on a tiny random
    model of every registered family. A feature whose prerequisite failed says so."""
    out = {}
    for model_type in model_types or registered_families():
        state: dict = {}
        try:
            hf = tiny_hf_model(WRAPS.get(model_type, model_type))
        except MatrixMismatch:
            raise
        except Exception as e:  # noqa: BLE001
            raise MatrixMismatch(f"{model_type}: the tiny HF model could not be built: {e!r}") from e
        for name, try_it in FAMILY_FEATURES.items():
            if name != next(iter(FAMILY_FEATURES)) and "model" not in state:
                out[(model_type, name)] = "needs from_hf"
                continue
            try:
                with torch.no_grad():
                    try_it(hf, state)
                out[(model_type, name)] = None
            except Exception as e:  # noqa: BLE001 (the matrix records what happens)
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                out[(model_type, name)] = f"{type(e).__name__}: {first[:200]}"
    return out
