"""Real models on qkv: load HF checkpoints, generate, verify caches.

Family modules (``family_*.py``) register the HF ``model_type`` values they build in
``loading.FAMILIES``; ``from_hf`` finds them.
"""

from __future__ import annotations

# Imported eagerly so that ``qkv.models.generate`` is the function (not its module of the same name).
from .engine import Engine, EngineResult, EngineUpdate
from .generate import GenerateOutput, generate
from .gqa import to_gqa
from .loading import FAMILIES, CheckpointError, from_hf
from .sampling import SamplingParams, TokenLogprobs
from .verify import VerifyReport, verify_cache

__all__ = ["from_hf", "FAMILIES", "CheckpointError", "generate", "GenerateOutput", "verify_cache", "VerifyReport",
           "to_gqa",
           "Engine", "EngineResult", "EngineUpdate", "SamplingParams", "TokenLogprobs"]
