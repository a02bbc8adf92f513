"""The gated residual hyper-connection of Qwen4-Exp: Qwen Team 2026, "Qwen4-Exp" model card, after
Hyper-Connections (Zhu et al. 2024, arXiv:2409.19606).

The residual stream is widened to ``S`` copies (``hc_count``) of width ``d``, a (B, N, S * d) tensor. Each block
(a mixer or a feed-forward) reads one width-``d`` input mixed from the normalized streams by a per-channel sigmoid
gate, and writes its output back into every stream with a per-stream weight in (0, 2)::

    h̃       = StreamRMSNorm(H)                                 each stream normalized alone, scale 1 + w
    g       = sigmoid(up(silu(down(h̃) / S)))                    (B, N, S * d), down: S*d -> r, up: r -> S*d
    x       = mean over the streams of g * h̃                    (B, N, d)        the block's input
    w       = 2 * sigmoid(inject(h̃) / S)                        (B, N, S)        inject: S*d -> S
    H'      = H + concat_s(w_s * block(x))                      the block's output into every stream

The model widens the embedding by repetition and reads its output through a last mixer without ``inject``
(:meth:`GatedResidual.collapse`), whose ``x`` goes straight to the LM head: Qwen4-Exp has no final norm.

Parameter names are HF's (``hc_norm``, ``input_mix_weight_down``, ``input_mix_weight_up``, ``block_inject_weight``).

Shape legend: B batch, N tokens, S streams (``hc_count``), d hidden size, r the mixer's rank (``hc_lowrank``).

Example:
    >>> import torch
    >>> res = GatedResidual(hidden_size=8, streams=2, rank=4)
    >>> h = torch.randn(1, 3, 8)
    >>> H = res.widen(h)                      # (1, 3, 16)
    >>> x, w = res.enter(H)
    >>> H2 = res.leave(H, torch.zeros_like(x), w)
    >>> H.shape, x.shape, torch.equal(H2, H)
    (torch.Size([1, 3, 16]), torch.Size([1, 3, 8]), True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GatedResidual", "StreamRMSNorm", "stream_rms_norm"]


def stream_rms_norm(x: torch.Tensor, weight: torch.Tensor, *, width: int, eps: float) -> torch.Tensor:
    """RMSNorm of each ``width``-channel slice of ``x`` (..., S * width) alone, scaled by ``1 + weight`` (S * width,);
    computed in float32 for low-precision inputs (float64 stays float64)."""
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    xs = x.to(work).unflatten(-1, (-1, width))
    y = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (y * (1.0 + weight.to(work))).to(x.dtype)


class StreamRMSNorm(nn.Module):
    """:func:`stream_rms_norm` with its weight (``S * width`` channels, stored around 0)."""

    def __init__(self, streams: int, width: int, *, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.width, self.eps = width, eps
        self.weight = nn.Parameter(torch.zeros(streams * width, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stream_rms_norm(x, self.weight, width=self.width, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, width={self.width}, eps={self.eps}"


class GatedResidual(nn.Module):
    """One block's gated hyper-connection (module notes); ``inject=False`` for the model's last mixer.

    Args:
        hidden_size: ``d``. streams: ``S`` >= 2 (``hc_count``). rank: ``r`` (``hc_lowrank``).
        eps: the stream norm's epsilon. inject: build ``block_inject_weight`` (a block's connection).
    """

    def __init__(self, hidden_size: int, streams: int, rank: int, *, eps: float = 1e-6, inject: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        for name, v, low in (("hidden_size", hidden_size, 1), ("streams", streams, 2), ("rank", rank, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"GatedResidual: {name} must be an int >= {low}, got {v!r}")
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.streams = hidden_size, streams
        wide = streams * hidden_size
        self.hc_norm = StreamRMSNorm(streams, hidden_size, eps=eps, **kw)
        self.input_mix_weight_down = nn.Linear(wide, rank, bias=False, **kw)
        self.input_mix_weight_up = nn.Linear(rank, wide, bias=False, **kw)
        self.block_inject_weight = nn.Linear(wide, streams, bias=False, **kw) if inject else None

    def _check(self, H: torch.Tensor) -> None:
        if not isinstance(H, torch.Tensor) or H.dim() != 3 or H.shape[-1] != self.streams * self.hidden_size:
            seen = tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__
            raise ValueError(f"GatedResidual: the streams must be (B, N, streams * hidden_size = "
                             f"{self.streams * self.hidden_size}), got {seen}; widen the embedding first (widen)")

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, S * d): every stream a copy of ``h``."""
        return h.repeat(1, 1, self.streams)

    def _mix(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(H)
        normed = self.hc_norm(H)
        gate = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.streams)))
        x = (gate * normed).unflatten(-1, (self.streams, self.hidden_size)).mean(-2)
        return x, normed

    def enter(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input ``x`` (B, N, d) and its streams' weights ``w`` (B, N, S)."""
        if self.block_inject_weight is None:
            raise ValueError("GatedResidual: this connection was built with inject=False (the model's last mixer); "
                             "it collapses the streams (collapse), it does not enter a block")
        x, normed = self._mix(H)
        return x, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.streams)

    def leave(self, H: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``H + concat_s(w_s * y)``: the block's output ``y`` (B, N, d) into the streams (B, N, S * d); ``H``, ``w``
        may hold only the last columns of ``y``'s (a decoder's last layer over its kept columns)."""
        n = y.shape[1]
        return H[:, -n:] + (w[:, -n:].unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)

    def collapse(self, H: torch.Tensor) -> torch.Tensor:
        """The streams' mixed read-out (B, N, d), what the model's last connection gives its LM head."""
        return self._mix(H)[0]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, streams={self.streams}, "
                f"rank={self.input_mix_weight_down.out_features}, inject={self.block_inject_weight is not None}")
