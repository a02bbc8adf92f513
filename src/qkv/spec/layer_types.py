"""The attention layer types a model description may hold, under HF ``transformers``' ``layer_types`` values.

``"full_attention"``: a global layer (every earlier token). ``"sliding_attention"``: a local layer that sees
and caches at most ``sliding_window`` tokens, the token itself included (HF's convention). Other HF values
(``"chunked_attention"`` of Llama 4, linear or recurrent layers, ...) are refused by the reader with a message
naming them.

Example:
    >>> from qkv.spec.layer_types import FULL_ATTENTION, LAYER_TYPES
    >>> FULL_ATTENTION in LAYER_TYPES
    True
"""

from __future__ import annotations

__all__ = ["FULL_ATTENTION", "SLIDING_ATTENTION", "LAYER_TYPES", "LAYER_KIND"]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: The layer types qkv builds, caches and costs.
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
#: Short names the cost tables print: ``"global"`` and ``"local"``.
LAYER_KIND = {FULL_ATTENTION: "global", SLIDING_ATTENTION: "local"}
