"""The attention layer types a model description may hold, under HF ``transformers``' ``layer_types`` values.

``"full_attention"``: a global layer (every earlier token). ``"sliding_attention"``: a local layer that sees
and caches at most ``sliding_window`` tokens, the token itself included (HF's convention).
``"linear_attention"``: a recurrent layer of a hybrid decoder (Qwen3-Next, Qwen3.5: Gated DeltaNet), whose
state does not grow with the context (:mod:`qkv.config.linear`). Other HF values (``"chunked_attention"`` of
Llama 4, ...) are refused by the reader with a message naming them.

Example:
    >>> from qkv.config.layer_types import FULL_ATTENTION, LAYER_TYPES
    >>> FULL_ATTENTION in LAYER_TYPES
    True
"""

from __future__ import annotations

__all__ = ["FULL_ATTENTION", "SLIDING_ATTENTION", "LINEAR_ATTENTION", "LAYER_TYPES", "DECODER_LAYER_TYPES",
           "LAYER_KIND"]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
#: The softmax attention layer types qkv builds, caches and costs.
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: The layer types of :class:`qkv.config.DecoderConfig` and the HF reader: attention and recurrent layers.
DECODER_LAYER_TYPES = (*LAYER_TYPES, LINEAR_ATTENTION)
#: Short names the cost tables print: ``"global"``, ``"local"`` and ``"recurrent"``.
LAYER_KIND = {FULL_ATTENTION: "global", SLIDING_ATTENTION: "local", LINEAR_ATTENTION: "recurrent"}
