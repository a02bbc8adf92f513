"""Interpretation of qkv models on their fast backends.

- :mod:`.capture`: the attention probabilities of any qkv model's layers, heads and rows, recomputed exactly
  from each layer's own q, k, mask and score modifiers through the modules' ``attention_fn`` hook.
- ``qkv.attention_stats``: column sums, entropy and attention to chosen keys in O(N) memory.
- :mod:`.rollout`: attention rollout and attention flow (Abnar & Zuidema 2020), Michel et al.'s formula.
- :mod:`.gates`: head gates, head importance (Michel et al. 2019), pruning curves;
  :mod:`.sentences`: the real measure for the bundled sentence encoder.
- :mod:`.patching`: head outputs, activation patching, zero and mean ablation.
- :mod:`.patterns`: previous-token, first-token (sink), induction and entropy scores per head.
- :mod:`.contacts`: symmetrized, APC-corrected maps and a logistic regression for contacts (Rao et al. 2020).
- :mod:`.plots` (PNG, matplotlib) and :mod:`.html` (one self-contained page, canvas-drawn).

Example:
    >>> import torch
    >>> from qkv.interpret import capture, attention_rollout
    >>> from qkv.nn import DecoderConfig, DecoderLM
    >>> lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
    ...                              num_attention_heads=4, intermediate_size=64)).eval()
    >>> maps = capture(lm, torch.randint(0, 50, (1, 6)))
    >>> attention_rollout(maps).shape
    torch.Size([1, 6, 6])
"""

from .._probs import AttentionStats, attention_stats
from .capture import attention_modules, capture, capture_stats
from .contacts import ContactRegression, apc, contact_features, fit_contact_regression, precision_at, symmetrize
from .gates import PruningCurve, head_counts, head_gates, model_head_importance, prune_heads, pruning_curve
from .html import attention_html, render_page, view_data
from .patching import ablate_heads, head_outputs, patch_heads
from .patterns import entropy_score, first_token_score, induction_maps, induction_score, previous_token_score
from .plots import plot_attention, plot_layer_grid, plot_pruning_curve, plot_rollout
from .rollout import FLOW_MAX_COST, attention_flow, attention_rollout, head_importance

__all__ = [
    "capture", "capture_stats", "attention_modules", "attention_stats", "AttentionStats",
    "attention_rollout", "attention_flow", "FLOW_MAX_COST", "head_importance",
    "head_gates", "prune_heads", "head_counts", "model_head_importance", "pruning_curve", "PruningCurve",
    "head_outputs", "patch_heads", "ablate_heads",
    "previous_token_score", "first_token_score", "induction_score", "induction_maps", "entropy_score",
    "symmetrize", "apc", "contact_features", "fit_contact_regression", "ContactRegression", "precision_at",
    "plot_attention", "plot_layer_grid", "plot_rollout", "plot_pruning_curve",
    "attention_html", "view_data", "render_page",
]
