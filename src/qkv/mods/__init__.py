"""Score modifiers: finite terms added to, or transforms of, attention scores. Several compose in order.

Example:
    >>> import torch
    >>> from qkv import mods
    >>> m = mods.softcap(50.0)
    >>> float(m.apply(torch.tensor(100.0), 0, 0, 0, 0, 1, 1)) < 50
    True
"""

from .base import Chain, ScoreMod, as_score_mod
from .library import alibi, bias, from_fn, relative_bias, softcap

__all__ = ["ScoreMod", "Chain", "as_score_mod", "alibi", "softcap", "relative_bias", "bias", "from_fn"]
