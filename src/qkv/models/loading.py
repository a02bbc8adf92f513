"""Loading HF checkpoints into qkv-native models: one loader, one module per family.

``from_hf(src)`` takes a local checkpoint directory (``config.json`` plus ``*.safetensors``; pickled
``*.bin`` files are never opened) or an in-memory HF ``PreTrainedModel``. The family module named by
the config's ``model_type`` builds the qkv model and renames the HF tensors; the loader then checks
the tensors strictly (missing, unexpected, wrong shape: each named) before anything is loaded.

A family module (``qkv/models/<family>.py``) provides:

- ``build(config: dict) -> torch.nn.Module``: the qkv-native model for an HF config dict.
- ``convert(state: dict[str, Tensor], config: dict) -> dict[str, Tensor]``: HF names and layouts to the
  qkv model's ``state_dict`` names (drop buffers HF keeps that qkv recomputes, e.g. rotary tables).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from ..config.config_file import read_json_config
from ..cpu import optimize as cpu_optimize

__all__ = ["FAMILIES", "from_hf", "load_config", "load_state_dict", "CheckpointError", "Renamer", "check_and_load",
           "check_fits"]

# HF model_type -> qkv module implementing it. Each family module registers here (one line).
FAMILIES: dict[str, str] = {}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model it claims to be (named tensors, shapes, types)."""


def load_config(src: str | Path) -> dict[str, Any]:
    path = Path(src)
    cfg = path / "config.json" if path.is_dir() else path
    if not cfg.is_file():
        raise FileNotFoundError(f"from_hf: no config.json in {path}; pass a checkpoint directory holding "
                                "config.json and *.safetensors")
    return _read_config_json(cfg)


def _read_config_json(cfg: Path) -> dict[str, Any]:
    """The JSON object in ``cfg``; ``CheckpointError`` naming the file for anything else."""
    try:
        return read_json_config(cfg)
    except ValueError as e:
        raise CheckpointError(f"from_hf: {e}") from None


#: dtype names ``from_hf(dtype=)`` accepts besides ``torch.dtype`` objects.
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64,
               "double": torch.float64}


def as_float_dtype(dtype, owner: str = "from_hf") -> torch.dtype:
    """A floating ``torch.dtype`` from a dtype or one of :data:`DTYPE_NAMES`; ``ValueError`` otherwise."""
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ValueError(f"{owner}: dtype {dtype!r} is not known; use 'auto' (the checkpoint's dtype), a "
                             f"torch.dtype or one of {', '.join(sorted(DTYPE_NAMES))}")
        return DTYPE_NAMES[name]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{owner}: dtype must be 'auto' (the checkpoint's dtype), a floating torch.dtype (e.g. "
                         f"torch.bfloat16) or a name such as 'bf16', got {dtype!r}")
    return dtype


def load_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (sharded checkpoints included)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        extra = f" (found {pickled}: pickled weights are never loaded; convert them to safetensors)" if pickled else ""
        raise FileNotFoundError(f"from_hf: no *.safetensors files in {directory}{extra}")
    for f in files:  # a FIFO or device named *.safetensors would block the reader forever
        if not f.is_file():
            raise CheckpointError(f"from_hf: {f} is not a regular file (a pipe, socket or device?); a safetensors "
                                  "shard must be a regular file")
    state: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for f in files:
        shard = _load_shard(load_file, f)
        for name in shard:
            if name in owner:
                raise CheckpointError(f"from_hf: tensor {name!r} is in two shards, {owner[name]} and {f.name}; a "
                                      "checkpoint holds each tensor once (remove the stale shard)")
            owner[name] = f.name
        state.update(shard)
    return state


def _load_shard(load_file, f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
        raise CheckpointError(f"from_hf: cannot read the safetensors shard {f}: {type(e).__name__}: {e}; the file "
                              "is truncated or not a safetensors file (download it again)") from None


def _family(config: dict[str, Any]):
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        _import_families()
    if model_type not in FAMILIES:
        raise CheckpointError(f"from_hf: unsupported model_type {model_type!r}; supported: "
                              f"{', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[model_type])


def _import_families() -> None:
    """Import every family module so each registers its model types."""
    import pkgutil

    import qkv.models as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("family_"):
            importlib.import_module(f"qkv.models.{info.name}")


def check_and_load(model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str = "checkpoint") -> None:
    """Load ``state`` into ``model`` strictly; raise ``CheckpointError`` naming every problem first."""
    check_fits(model, state, source=source)
    expected = model.state_dict()
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def check_fits(model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str = "checkpoint") -> None:
    """Raise ``CheckpointError`` naming every missing, unexpected, mis-shaped or integer tensor of ``state`` for
    ``model`` (which may live on the meta device: only names, shapes and dtypes are read)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{name}: checkpoint {tuple(state[name].shape)} vs model {tuple(expected[name].shape)}"
              for name in sorted(set(state) & set(expected)) if state[name].shape != expected[name].shape]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if shapes:
        problems.append("shape mismatches: " + "; ".join(shapes[:8]))
    ints = [f"{name} ({state[name].dtype})" for name in sorted(set(state) & set(expected))
            if expected[name].dtype.is_floating_point and not state[name].dtype.is_floating_point]
    if ints:
        problems.append(f"non-float weights {ints[:8]}: model weights must be floating point (quantized integer "
                        "checkpoints are not supported)")
    if problems:
        raise CheckpointError(f"from_hf: {source} does not fit {type(model).__name__}: " + " | ".join(problems))


def from_hf(src, *, dtype: torch.dtype | str | None = "auto", optimize: bool = True,
            weights: str | None = None) -> torch.nn.Module:
    """Build a qkv-native model from an HF checkpoint directory or an in-memory ``PreTrainedModel``.

    Args:
        src: path to a directory with ``config.json`` and ``*.safetensors``, or a ``transformers``
            ``PreTrainedModel`` instance (its config and weights are used directly).
        dtype: ``"auto"`` (default; ``None`` is the same) keeps the checkpoint's dtype, as HF's and vLLM's
            loaders do: a directory's ``config.json`` ``dtype`` (or the older ``torch_dtype``), else the dtype
            of most of its safetensors weights; an in-memory model's is the dtype of most of its floating
            parameters. Anything else casts the model to that dtype after loading: a ``torch.dtype`` or a name
            such as ``"float32"``, ``"bf16"``, ``"float16"`` (``dtype=torch.float32`` runs a bfloat16
            checkpoint in float32).
        optimize: give the model qkv's CPU products (:func:`qkv.cpu.optimize`: the same parameters and
            ``state_dict``, faster CPU inference; a float32 weight multiplied by many rows, as in a prefill,
            gets a packed oneDNN copy, twice its memory); False returns the plain model
            (``qkv.cpu.optimize(model, onednn=False)`` then gives the products without the copies).
        weights: with ``optimize``, :func:`qkv.cpu.optimize`'s weight format: None (default) keeps every weight
            in its dtype; ``"bf16-exact"`` holds the float32 weights that are all bfloat16 values (a bf16
            checkpoint loaded with ``dtype=torch.float32``) in bfloat16, the same numbers at half the bytes
            (lossless, inference only); ``"int8"`` quantizes the linear layers (lossy).

    Example:
        >>> import qkv.models  # doctest: +SKIP
        >>> model = qkv.models.from_hf("path/to/all-MiniLM-L6-v2")  # doctest: +SKIP
    """
    if not isinstance(optimize, bool):
        raise TypeError(f"from_hf: optimize must be True or False, got {optimize!r}")
    if weights is not None and not optimize:
        raise ValueError(f"from_hf: weights={weights!r} is a format of qkv.cpu.optimize; pass optimize=True (the "
                         f"default) with it, or weights=None")
    if isinstance(src, (str, Path)):
        config = load_config(src)
        state = load_state_dict(src)
        source = str(src)
    elif _is_transformers_model(src):
        config = src.config.to_dict()
        state = dict(src.state_dict())
        source = f"in-memory {type(src).__name__}"
    else:
        raise TypeError(f"from_hf: expected a checkpoint directory or a transformers PreTrainedModel, got "
                        f"{type(src).__name__}")
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        dtype = _checkpoint_dtype(config, state) if isinstance(src, (str, Path)) else _majority_dtype(
            src.parameters())
    else:
        dtype = as_float_dtype(dtype)
    family = _family(config)
    converted = family.convert(state, config)
    _check_on_meta(family, config, converted, source)
    model = _build(family, config)
    check_and_load(model, converted, source=source)
    model.eval()
    model = model.to(dtype)
    return cpu_optimize(model, weights=weights) if optimize else model


def _majority_dtype(tensors) -> torch.dtype:
    """The floating dtype holding most elements of ``tensors`` (float32 when none is floating)."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.dtype.is_floating_point:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _checkpoint_dtype(config: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a checkpoint directory was saved in: ``config.json``'s ``dtype`` (transformers 5) or
    ``torch_dtype`` (earlier), else the dtype most of its floating tensors have."""
    for key in ("dtype", "torch_dtype"):
        name = config.get(key)
        if name is None:
            continue
        if not isinstance(name, str) or name.lower().removeprefix("torch.") not in DTYPE_NAMES:
            raise CheckpointError(f"from_hf: config.json {key}={name!r} is not a floating dtype qkv can load; pass "
                                  f"dtype= (e.g. dtype=torch.float32) to choose one")
        return DTYPE_NAMES[name.lower().removeprefix("torch.")]
    return _majority_dtype(state.values())


def _check_on_meta(family, config: dict[str, Any], state: dict[str, torch.Tensor], source: str) -> None:
    """Compare names and shapes on a meta-device build first, so a config that does not fit its weights (a huge
    hidden size, thousands of layers) is refused before any real memory is allocated or initialised."""
    try:
        with torch.device("meta"):
            skeleton = _build(family, config)
    except (NotImplementedError, RuntimeError):  # a family whose construction reads tensor values: check later
        return
    check_fits(skeleton, state, source=source)


def _is_transformers_model(src) -> bool:
    """True for a ``transformers.PreTrainedModel`` (transformers imported only when it is installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(src, PreTrainedModel)


def _build(family, config: dict[str, Any]) -> torch.nn.Module:
    """The family's model for ``config``; a config value of the wrong kind is a ``CheckpointError`` naming it."""
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size"):
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] <= 0):
            raise CheckpointError(f"from_hf: config {key} must be a positive int, got {config[key]!r}")
    eps = config.get("rms_norm_eps", config.get("layer_norm_eps", config.get("layer_norm_epsilon")))
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0):
        raise CheckpointError(f"from_hf: config norm epsilon must be a number > 0, got {eps!r}")
    try:
        return family.build(config)
    except KeyError as e:
        raise CheckpointError(f"from_hf: the {config.get('model_type')} config lacks {e.args[0]!r}; "
                              "config.json must hold every field its model type needs") from None


class Renamer:
    """Moves HF tensors to qkv names for a family's ``convert``, collecting every missing one.

    ``move(hf, qkv)`` renames a tensor; ``has(hf, qkv)`` checks for one (recording it as missing if absent) before
    a family reshapes it itself. ``finish`` drops a tied LM head (the model reads the embedding) or moves an
    untied one, raises :class:`CheckpointError` naming all missing tensors, and leaves unknown tensors under
    their HF names for the loader to report as unexpected.
    """

    def __init__(self, state: dict[str, torch.Tensor], family: str) -> None:
        self.src, self.family = dict(state), family
        self.out: dict[str, torch.Tensor] = {}
        self.missing: list[str] = []

    def has(self, hf: str, qkv: str) -> bool:
        if hf not in self.src:
            self.missing.append(f"{hf} (qkv {qkv})")
        return hf in self.src

    def move(self, hf: str, qkv: str) -> None:
        if self.has(hf, qkv):
            self.out[qkv] = self.src.pop(hf)

    def finish(self, *, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
        if tie_word_embeddings:
            self.src.pop("lm_head.weight", None)
        else:
            self.move("lm_head.weight", "lm_head.weight")
        if self.missing:
            more = " ..." if len(self.missing) > 8 else ""
            extra = f"; unexpected tensors {sorted(self.src)[:8]}" if self.src else ""
            raise CheckpointError(f"from_hf: {self.family} checkpoint is missing tensors {self.missing[:8]}{more}"
                                  f"{extra}")
        return {**self.out, **self.src}
