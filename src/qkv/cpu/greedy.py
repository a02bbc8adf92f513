"""Greedy tokens of an LM head through an int8 screen: the argmax of ``x @ W.T`` without the float32 product.

A decode step's largest product is often its LM head (32000 x 512 floats are 65 MB, read once per step), yet greedy
decoding keeps one index per row. :class:`HeadScreen` holds the head once more in int8 (a quarter of the bytes: each
row as a scale times integers in [-127, 127]), takes each input row to 8-bit integers (one byte plane, where its
error stays near the head's and more than eight rows share the product) or 16-bit ones (two planes: few rows, or
rows with large outliers), and multiplies them exactly in integers on the CPU's int8 units (oneDNN's batch-reduce
GEMM through torch, AMX or AVX512-VNNI; without them, AVX2's 16-bit multiply-adds in ``csrc/greedy_head.cpp``).
Every approximate logit gets a rigorous bound on its distance from the
float32 logit (both quantizations by Cauchy-Schwarz, the float32 GEMM's accumulation by Higham's gamma_K;
``csrc/greedy_head.cpp`` writes the bound out), and only the tokens whose upper bound reaches the row's largest
lower bound are recomputed in float64: a handful per row. The token is the first largest of those float64 logits, so
it is the argmax of the float32 logits wherever that is determined at all (two logits closer than a float32
product's rounding, about 1e-6 relative, can come out in either order from any two float32 GEMMs). Rows the screen
cannot settle (a non-finite input or logit) take ``F.linear`` and ``argmax``. A final logit soft-cap (Gemma 2-4's
``cap * tanh(l / cap)``) keeps the candidates, and the kernel compares their capped values in float64; since float32
rounding can make two capped logits equal (then the first index wins, not the larger logit), a row whose capped
winner is within a few float32 units of another token's is left to the float32 logits.

A bfloat16 model's head is screened the same way (the screen packed from its values, the candidates read from the
bfloat16 head itself), but its logits are float32 sums rounded to bfloat16 (the bf16-weight kernel of
:mod:`qkv.cpu.weights` for few rows), so two logits within a bfloat16 unit (2^-8 relative) tie and the first index
wins: a row is settled only when its winner's lowest possible float32 sum stands more than a bfloat16 unit above
every other token's highest (the float32 sums' own error bounded by Higham's gamma_K, as below); other rows take the
model's own bfloat16 logits.

The screen's bytes matter twice: a step reads a quarter of the float32 head, and the decoder's own weights are more
likely to stay in the CPU's last-level cache between steps when the head beside them is small.

It runs where qkv's compiled CPU kernels run (:func:`screen_unavailable_reason` says why not, and there the float32
head runs), for heads of up to 65,536 inputs (the integer sums stay exact). The screen costs a quarter of the head's
memory again; it is built on first use and rebuilt when the weight changes (as
:class:`qkv.cpu.gemm.PrepackedWeight`). :func:`qkv.cpu.optimize` gives
one to every module that declares :class:`GreedyHead` (``qkv.nn.DecoderLM``), whose ``next_tokens`` uses it;
``qkv.models.generate`` (greedy, without ``return_logits``) and ``qkv.models.Engine`` decode through
``next_tokens``.

Example:
    >>> import torch
    >>> from qkv.cpu.greedy import HeadScreen, screen_unavailable_reason
    >>> w, x = torch.randn(1000, 64), torch.randn(3, 64)
    >>> screen = HeadScreen()
    >>> tokens = screen.tokens(x, w) if screen_unavailable_reason() is None else (x @ w.T).argmax(-1)
    >>> torch.equal(tokens, (x.double() @ w.double().T).argmax(-1))
    True
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from . import ops
from .gemm import linear

__all__ = ["HeadScreen", "PackedScreen", "GreedyHead", "screen_unavailable_reason", "MAX_INPUTS", "SCREEN_ROWS"]

#: The logits' dtypes the screen settles -> their significand bits (``screened_argmax``'s ``logit_bits``).
_LOGIT_BITS = {torch.float32: 24, torch.bfloat16: 8}

#: Rows up to which a model's greedy head goes through the screen (:meth:`HeadScreen.screens`), following
#: ``benchmarks/results/skinny_bf16.json``'s ``head`` rows (the screen against the head's own product on a packed
#: copy and argmax, 1-32 rows): a bfloat16 head's product (AVX512-BF16 dot products) is faster from 8 rows; a
#: float32 head's never was, so its bound is the most rows measured.
SCREEN_ROWS = {torch.float32: 32, torch.bfloat16: 4}

#: The most inputs (K) a screened head may have: the screen's int32 sums of K products of 255 x 127 stay exact.
MAX_INPUTS = 65536


class PackedScreen(NamedTuple):
    """An LM head ``W (V, K)`` packed for the screen (``screen_pack`` in ``csrc/greedy_head.cpp``); ``Vp`` is V
    rounded up to whole blocks of 32 entries, ``Kp`` K to whole groups of four (padding entries are zero).

    Attributes:
        packed: ``(Vp / 32, Kp, 32)`` int8, each row as integers in [-127, 127], in the VNNI layout of torch's
            batch-reduce GEMM (where this CPU has no int8 GEMM: each block as ``(Kp / 2, 32, 2)``, two inputs of an
            entry adjacent).
        norms: ``(Vp,)`` float32, ``|w_n|``.
        errors: ``(Vp,)`` float32, ``|w_n - s_n q_n|`` (rounded up).
        max_errors: ``(Vp,)`` float32, ``|w_n - s_n q_n|_inf`` (rounded up).
        scales: ``(Vp,)`` float32, the scales ``s_n``.
        sums: ``(Vp,)`` int32, the sums of the integers ``q_n``.
        relative_error: ``(1,)`` float32, the head's ``sum errors / sum norms`` (an input row goes in one byte
            plane when its own relative error is at most a small multiple of it).
    """

    packed: torch.Tensor
    norms: torch.Tensor
    errors: torch.Tensor
    max_errors: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor
    relative_error: torch.Tensor


def pack(weight: torch.Tensor) -> PackedScreen:
    """The screen of a contiguous float32 ``weight (V, K)``, ``K <= MAX_INPUTS`` (qkv's kernels must run here)."""
    return PackedScreen(*ops.screen_pack(weight))


@functools.cache
def _probe() -> str | None:
    if ops.unavailable_reason() is not None:
        return f"qkv's CPU kernels are unavailable ({ops.unavailable_reason()})"
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(100, 16, generator=g), torch.randn(4, 16, generator=g)
    try:
        tokens, ok, *_ = ops.screened_argmax(x, w, *pack(w))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"this CPU or torch build has no int8 GEMM for the screen ({first})"
    if not bool(ok.all()) or not torch.equal(tokens, (x.double() @ w.double().T).argmax(-1)):
        return "the int8 screen gave a wrong token on its probe in this build"
    return None


def screen_unavailable_reason() -> str | None:
    """Why :class:`HeadScreen` cannot run here (then the float32 head runs), or None when it can: qkv's compiled
    kernels, and a probe's tokens equal to float64's."""
    if ops.unavailable_reason() is not None:
        return f"qkv's CPU kernels are unavailable ({ops.unavailable_reason()})"
    return _probe()


def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The head's logits where the screen does not run: :func:`qkv.cpu.gemm.linear`, the product rule the model's
    own head follows (without a packed copy: the weight-streaming kernel for few rows, else ``F.linear``)."""
    return linear(x, weight)


def _capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in the logits' dtype (``qkv.nn.DecoderLM``'s final soft-cap), or the logits."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


class HeadScreen:
    """The int8 screen of one LM head weight, built on first use and rebuilt when the weight changes (another
    tensor, new storage, or an in-place write seen by its version counter; as :class:`qkv.cpu.gemm.PrepackedWeight`,
    an in-place write to an inference tensor is not seen). :meth:`tokens` gives greedy tokens."""

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self._key: tuple | None = None
        self._screen: PackedScreen | None = None  # None with a key: the weight is not finite

    def __deepcopy__(self, memo) -> HeadScreen:  # a copy builds its own screen lazily
        return HeadScreen()

    def __getstate__(self) -> dict:
        return {"_source": None, "_key": None, "_screen": None}

    def usable(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`tokens` screens this product (float32 or bfloat16 CPU tensors, x and weight of one dtype,
        without gradient, at most :data:`MAX_INPUTS` inputs, a finite weight, the screen available here); else it
        computes the logits."""
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if (grad or x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype not in _LOGIT_BITS
                or weight.dtype != x.dtype or weight.dim() != 2 or x.shape[-1] != weight.shape[1]
                or weight.shape[1] > MAX_INPUTS or x.numel() == 0 or screen_unavailable_reason() is not None):
            return False
        return self._get(weight) is not None

    def screens(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a model should take its greedy tokens from :meth:`tokens` for these rows: :meth:`usable` and at
        most :data:`SCREEN_ROWS` rows (more rows: the head's own product is faster)."""
        K = x.shape[-1] if x.dim() else 0
        return bool(K) and x.numel() // K <= SCREEN_ROWS.get(x.dtype, 0) and self.usable(x, weight)

    def _get(self, weight: torch.Tensor) -> PackedScreen | None:
        version = None if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, tuple(weight.shape))
        if self._source is not weight or self._key != key:
            with torch.no_grad():
                w = weight.detach().contiguous()
                self._screen = pack(w.float()) if bool(torch.isfinite(w).all()) else None
            self._source, self._key = weight, key
        return self._screen

    def tokens(self, x: torch.Tensor, weight: torch.Tensor, cap: float | None = None) -> torch.Tensor:
        """``(x @ weight.T).argmax(-1)`` for x (..., K) and weight (V, K): int64 tokens of shape ``x.shape[:-1]``;
        with a final logit soft-cap ``cap`` (> 0), the argmax of ``cap * tanh(x @ weight.T / cap)`` computed as the
        model does (in the logits' dtype, so float32 rounding may tie two logits and the first wins). A bfloat16 x
        and weight give the argmax of the bfloat16 logits (float32 sums rounded to bfloat16, the first index on
        ties). Through the screen where :meth:`usable`, else (and for rows it cannot settle: a non-finite input or
        logit, or a winner within a few units of the logits' format of another token's value) the model's logits
        (float32, or the bfloat16 ones of :mod:`qkv.cpu.weights`' kernel)."""
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
            raise TypeError(f"HeadScreen.tokens: x and weight must be tensors, got {type(x).__name__} and "
                            f"{type(weight).__name__}")
        if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"HeadScreen.tokens: x (..., K) and weight (V, K) must share K, got x "
                             f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not 0 < cap < float("inf")):
            raise ValueError(f"HeadScreen.tokens: cap must be None (no soft-cap) or a finite number > 0, got {cap!r}")
        lead, K = x.shape[:-1], x.shape[-1]
        if not self.usable(x, weight):
            return _capped(_logits(x, weight), cap).argmax(-1)
        rows = x.reshape(-1, K).contiguous()
        with torch.no_grad():
            tokens, ok, *_ = ops.profiled("head_screen", ops.screened_argmax, rows.float(),
                                          weight.detach().contiguous(), *self._screen, cap or 0.0,
                                          _LOGIT_BITS[x.dtype])
            if not bool(ok.all()):  # rows the screen cannot settle: the model's own logits, as it rounds them
                bad = (~ok).nonzero()[:, 0]
                tokens[bad] = _capped(_logits(rows[bad], weight), cap).argmax(-1)
        return tokens.view(lead)

    def __repr__(self) -> str:
        held = "empty" if self._key is None else "not finite" if self._screen is None else \
            f"{self._key[2][0]}x{self._key[2][1]}"
        return f"HeadScreen({held})"


@runtime_checkable
class GreedyHead(Protocol):
    """A model whose greedy tokens may go through a :class:`HeadScreen` held in ``head_screen`` (None: the float32
    head). :func:`qkv.cpu.optimize` sets one where the screen runs."""

    head_screen: HeadScreen | None
