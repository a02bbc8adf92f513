"""The one way :class:`qkv.nn.DecoderLayer` builds and calls its token mixer, whatever its kind.

A mixer (softmax attention, MLA, DSA, Gated DeltaNet, Kimi Delta Attention, ...) follows :class:`DecoderMixer`:

- ``Cls.for_decoder(config, layer_idx, rope)`` builds it for layer ``layer_idx`` of a
  :class:`qkv.config.DecoderConfig` (``rope``: the model's rotary table of that layer's type, or None);
- ``mixer.mix(x, step, keep)`` maps the normed residual stream ``x`` (B, N, d) to (B, N, d), or to the last
  ``keep`` columns (B, keep, d) where it can skip the others (the decoder slices the rest); ``step``
  (:class:`MixerStep`) carries what every layer of one forward shares: positions, the cache, the step's masks
  and rotary angles;
- ``mixer.score_modifiers()`` names what it adds to attention scores beyond ``q.k`` (ALiBi, a softcap), so
  the decoder refuses caches that rank tokens by ``q.k`` alone; ``()`` for the others.

Which kind each layer is, and the torch-free facts of each kind, are :mod:`qkv.config.mixers`'; the class of each
kind is :mod:`qkv.nn.mixers`'. :func:`mix_recurrent` is the cache round trip every recurrent mixer shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ._recurrent import RecurrentState

if TYPE_CHECKING:
    from ..cache.protocol import AttentionCache
    from ..config.decoder import DecoderConfig

__all__ = ["DecoderMixer", "MixerStep", "mix_recurrent"]


class MixerStep(Protocol):
    """What the layers of one decoder forward share (built once per step by :class:`qkv.nn.DecoderLM`)."""

    positions: torch.Tensor | None  # (B, N) absolute positions, -1 on padding; None: 0 .. N-1
    cache: AttentionCache | None
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # without a cache: keys and values later layers share
    side_states: dict[int, tuple[torch.Tensor, ...]]  # with a cache: a layer's side state to keep with its own

    def real_tokens(self) -> torch.Tensor | None:
        """(B, N, 1): 1 on real tokens, 0 on padding; None without padding."""

    def cos_sin(self, table: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary cos and sin of a rotary table, computed once for every layer that shares it."""

    def self_mask(self, window: int | None) -> Any:
        """The step's causal (windowed) mask when there is no cache, built once per window."""


@runtime_checkable
class DecoderMixer(Protocol):
    """A decoder layer's token mixer (module notes)."""

    layer_idx: int

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope: Any) -> DecoderMixer:
        """The mixer of layer ``layer_idx`` of ``config``."""

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """(B, N, d) -> (B, N, d), or (B, keep, d) when it keeps only the last ``keep`` columns."""

    def score_modifiers(self) -> tuple:
        """What modifies its attention scores beyond ``q.k`` (empty: nothing)."""


def mix_recurrent(mixer, x: torch.Tensor, step: MixerStep) -> torch.Tensor:
    """A recurrent mixer over one step's tokens (B, N, d) -> (B, N, d), its state read from and written to the cache
    (under the mixer's ``layer_idx``). Padding writes nothing (the state only decays from zero before a left-padded
    row); one new token per row with a state takes the mixer's ``step``."""
    real, cache, i = step.real_tokens(), step.cache, mixer.layer_idx
    if real is not None:
        x = x * real
    state = None if cache is None else cache.recurrent_state(i)
    if state is not None and len(state) > 2:  # a side state kept beside the layer's (RecurrentSpec.side)
        state = RecurrentState(state[0], state[1])
    res = mixer.step(x, state) if x.shape[1] == 1 and state is not None else mixer(x, state=state)
    if cache is not None:
        side = step.side_states.pop(i, ())  # what a module before the mixer keeps with it (Qwen4-Exp's PLE)
        cache.update_recurrent(i, (*res.state, *side) if side else res.state, tokens=x.shape[1])
    return res.out
