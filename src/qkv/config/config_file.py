"""Reading a HF ``config.json`` safely: a regular file of bounded size, UTF-8, holding a JSON object whose
layout fields have the right kinds. Every problem is a ``ValueError`` naming the file, what was seen and the fix.

Example:
    >>> check_layout_fields({"num_hidden_layers": 2, "num_attention_heads": 4}, "cfg")
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_CONFIG_BYTES", "read_json_config", "check_layout_fields"]

#: Largest config file read (real ones are a few KiB; this refuses devices, FIFOs and mistaken weights files).
MAX_CONFIG_BYTES = 16 * 2**20


def read_json_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming the file for anything else (``OSError`` when it
    cannot be opened)."""
    path = os.fspath(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file (a device, FIFO or socket); pass the path of a config.json")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is {st.st_size:,} bytes, too large for a config.json (at most "
                         f"{MAX_CONFIG_BYTES:,}); pass the model's config.json, not a weights file")
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); a config.json is UTF-8 "
                         "JSON") from None
    if not text.strip():
        raise ValueError(f"{path} is empty; a config.json holds a JSON object with the model's settings")
    try:
        config = json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: the JSON nests too deeply to be a config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, expected an object "
                         '({"model_type": ..., "num_hidden_layers": ..., ...})')
    return config


_POSITIVE_INTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                  "sliding_window", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "max_position_embeddings", "vocab_size", "sliding_window_pattern")


def check_layout_fields(config: Mapping[str, Any], source: str) -> None:
    """Refuse layout fields of the wrong kind in a HF config (the top level and ``text_config``)."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise ValueError(f"{source}: text_config must be an object, got {type(text).__name__} {text!r}")
    for cfg in (config, text or {}):
        for key in _POSITIVE_INTS:
            v = cfg.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{source}: {key} must be a positive integer, got {v!r}")
        types = cfg.get("layer_types")
        if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
            raise ValueError(f"{source}: layer_types must be a list of strings (one per layer), got {types!r}")
