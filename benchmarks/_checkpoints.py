"""Random-weight checkpoints at the shapes people run, shared by the peer benchmarks (``vs_vllm.py``,
``vs_llamacpp.py``, ``generate.py``): one HF directory (``config.json`` + safetensors shards) that every engine
loads, so they all multiply the same weights.

Shapes (:data:`SHAPES`) copy the published configs' sizes (layers, width, heads, KV heads, MLP width, vocabulary,
tied head, Qwen2's query/key/value biases); positions and RoPE are plain (no RoPE scaling: it changes no cost).
Weights are redrawn at unit scale (embeddings N(0, 1), products N(0, 1/fan_in), biases N(0, 0.1^2), norms
1 + N(0, 0.2^2)): HF's 0.02 init makes the logits nearly flat, so greedy choices would hinge on rounding and the
engines' tokens could not be compared; at unit scale the greedy tokens vary from step to step (each suite
reports how many distinct tokens a row emitted). The tensors are drawn in float32 from one seed and stored in
the requested dtype, so a bfloat16 checkpoint holds the float32 one's values rounded.

The tensors are written shard by shard (at most ~1 GB in memory at once) from a meta-device model's names and
shapes, so a 3B checkpoint never needs HF to initialise a model in memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

__all__ = ["SHAPES", "DEFAULT_SHAPES", "add_shapes_flag", "build_checkpoint", "shape_names"]

#: name -> (HF config class, HF model class, config fields)
SHAPES: dict[str, tuple[str, str, dict]] = {
    "tiny": ("LlamaConfig", "LlamaForCausalLM", dict(  # a smoke run's model (head dim 64: vLLM's CPU kernels take it)
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "qwen2.5-3b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
}

_SHARD_BYTES = 1 << 30
#: the peer suites' default shapes (``tiny`` is their ``--quick`` one)
DEFAULT_SHAPES = "qwen2.5-0.5b,llama-3.2-1b,qwen2.5-3b"


def add_shapes_flag(parser) -> None:
    """The ``--shapes`` option of a peer suite (read it with :func:`shape_names`)."""
    parser.add_argument("--shapes", default=None, help=f"comma-separated shapes of benchmarks/_checkpoints.py "
                        f"(default: {DEFAULT_SHAPES}; tiny with --quick); choices: {', '.join(SHAPES)}")


def shape_names(text: str | None, quick: bool = False) -> list[str]:
    """Comma-separated shape names (None: ``tiny`` when ``quick``, else :data:`DEFAULT_SHAPES`), checked against
    :data:`SHAPES` (``SystemExit`` naming the choices)."""
    text = text or ("tiny" if quick else DEFAULT_SHAPES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        raise SystemExit(f"unknown shape(s) {unknown or text!r}; choose from {', '.join(SHAPES)}")
    return names


def _draw(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    low = name.lower()
    if "norm" in low:
        return 1.0 + 0.2 * noise
    if "embed_tokens" in low:
        return noise
    if low.endswith(".bias"):
        return 0.1 * noise
    return noise / math.sqrt(shape[-1])


def build_checkpoint(path: Path, shape: str, dtype: torch.dtype, *, max_position: int = 1024) -> dict:
    """Write the random-weight checkpoint of ``shape`` in ``dtype`` to ``path`` (kept when its ``config.json``
    already says this shape, dtype and seed); returns the config fields."""
    import transformers
    from safetensors.torch import save_file

    cfg_cls, model_cls, fields = SHAPES[shape]
    fields = dict(fields, max_position_embeddings=max_position)
    dtype_name = str(dtype).removeprefix("torch.")
    stamp = {"shape": shape, "dtype": dtype_name, "seed": 0}
    cfg_file = path / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()).get("qkv_bench") == stamp:
        return fields
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        stale.unlink()
    config = getattr(transformers, cfg_cls)(**fields)
    with torch.device("meta"):
        skeleton = getattr(transformers, model_cls)(config)
    names = [(n, p.shape) for n, p in skeleton.named_parameters()]  # a tied head is one parameter, saved once
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, {}
    files: list[str] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            file = f"part-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            files.append(file)
            index.update({k: file for k in shard})
            shard, size = {}, 0

    for name, shp in names:
        t = _draw(name, shp, gen).to(dtype).contiguous()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= _SHARD_BYTES:
            flush()
    flush()
    # HF's names: one file is model.safetensors, several are model-i-of-n.safetensors with an index
    final = (["model.safetensors"] if len(files) == 1
             else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for old, new in zip(files, final):
        (path / old).rename(path / new)
    if len(files) > 1:
        renamed = dict(zip(files, final))
        weight_map = {k: renamed[f] for k, f in index.items()}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_dict = config.to_dict()
    # vLLM's transformers (< 5.20) reads the older RoPE and dtype fields; keep both spellings
    config_dict.update(rope_theta=fields["rope_theta"], rope_scaling=None, torch_dtype=dtype_name, dtype=dtype_name,
                       architectures=[model_cls], qkv_bench=stamp)
    cfg_file.write_text(json.dumps(config_dict, indent=2))
    return fields
