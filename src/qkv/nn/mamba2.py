"""``Mamba2Mixer``: Mamba2's SSD layer, parameters named as HF's ``Mamba2Mixer`` so its weights load by name.

Dao and Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space
Duality", ICML 2024 (arXiv:2405.21060). The selective SSM with a scalar ``A`` per head is gated linear attention
with one log-decay per head: with ``dt = softplus(dt_raw + dt_bias)``::

    h_t = exp(A dt_t) h_{t-1} + B_t (dt_t x_t)^T       y_t = h_t^T C_t + D x_t

is :func:`qkv.linear.gated_linear_chunked` with ``q = C``, ``k = B``, ``v = dt x``, ``g = A dt`` (the state
``(Ns, P)`` per head; HF keeps its transpose), and ``n_groups`` groups of B and C shared by the heads as key
heads are shared by value heads. Per token ``x`` (B, N, E)::

    z, xBC, dt_raw = in_proj(x)
    x, B, C        = silu(causal depthwise conv_K(xBC))       padding zeroed again after the convolution
    y              = SSD(x, B, C, dt) + D x
    out            = out_proj(grouped_rms_norm(y * silu(z)) * norm.weight)     gate before the norm

Shape legend: B batch, N tokens, E hidden size, I = H P inner width, H heads, P head dim, G groups, Ns state
size, K taps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qkv.cache.specs import RecurrentSpec
from qkv.linear import LinearAttentionOutput, gated_linear_chunked, gated_linear_step
from qkv.nn._recurrent import RecurrentState, causal_conv, check_input, check_state, mask_padding
from qkv.nn.protocol import apply_head_gate

__all__ = ["Mamba2Mixer", "GroupedGatedRMSNorm"]


class GroupedGatedRMSNorm(nn.Module):
    """``rms_norm(y * silu(z))`` over each group of ``dim / n_groups`` channels, times ``weight`` (Mamba2's norm:
    the gate comes before the norm), in float32 for low-precision inputs."""

    def __init__(self, dim: int, n_groups: int, *, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.n_groups, self.eps = n_groups, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        work = y.dtype if y.dtype in (torch.float32, torch.float64) else torch.float32
        h = (y.to(work) * F.silu(z.to(work))).unflatten(-1, (self.n_groups, -1))
        h = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, n_groups={self.n_groups}, eps={self.eps}"


class Mamba2Mixer(nn.Module):
    """Mamba2 token mixer (SSD with a short convolution and a gated, grouped RMS norm).

    Args:
        hidden_size: E.
        num_heads: H.
        head_dim: P; the inner width is ``H * P`` (HF's ``expand * hidden_size``).
        state_size: Ns.
        n_groups: G, groups of B and C; divides H.
        conv_kernel: K.
        use_bias: bias in ``in_proj`` and ``out_proj``.
        use_conv_bias: bias in the convolution.
        time_step_limit: ``(lo, hi)`` clamp of ``dt`` after the softplus.
        norm_eps: epsilon of the gated norm (``layer_norm_epsilon``).
        chunk_size: tokens per chunk of the prefill; ``None`` lets the chunked form choose for its path.
        layer_idx: this layer's index among the model's layers (and in a KV cache).
        device, dtype: for the parameters.

    Example:
        >>> import torch
        >>> layer = Mamba2Mixer(32, num_heads=4, head_dim=16, state_size=8, n_groups=2)
        >>> x = torch.randn(2, 10, 32)
        >>> out, state = layer(x[:, :9])
        >>> y, state = layer.step(x[:, 9:], state)
        >>> torch.allclose(y, layer(x).out[:, 9:], atol=1e-5)
        True
    """

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, state_size: int, n_groups: int = 1,
                 conv_kernel: int = 4, use_bias: bool = False, use_conv_bias: bool = True,
                 time_step_limit: tuple[float, float] = (0.0, math.inf), norm_eps: float = 1e-5,
                 chunk_size: int | None = None, layer_idx: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                          ("state_size", state_size), ("n_groups", n_groups), ("conv_kernel", conv_kernel)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"Mamba2Mixer: {name} must be a positive int, got {val!r}")
        if num_heads % n_groups:
            raise ValueError(f"Mamba2Mixer: n_groups={n_groups} must divide num_heads={num_heads}")
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.ssm_state_size, self.n_groups, self.conv_kernel_size = state_size, n_groups, conv_kernel
        self.time_step_limit, self.norm_eps, self.chunk_size = tuple(time_step_limit), norm_eps, chunk_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias,
                                padding=conv_kernel - 1, **kw)
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias, **kw)
        self.dt_bias = nn.Parameter(torch.ones(num_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, **kw)))
        self.D = nn.Parameter(torch.ones(num_heads, **kw))
        self.norm = GroupedGatedRMSNorm(self.intermediate_size, n_groups, eps=norm_eps, **kw)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias, **kw)
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = num_heads, n_groups  # heads read their group's B and C, as GQA's
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1

    @property
    def attention_fn(self) -> None:
        """None: a recurrent mixer makes no softmax operator call to hook, so tools that replace the operator
        (capture, packed documents, context parallelism) refuse it (:class:`qkv.nn.protocol.AttentionModule`)."""
        return None

    def _mix(self, x: torch.Tensor, state: RecurrentState | None, attention_mask, *, fn: str, one_token: bool):
        check_input(x, self.hidden_size, fn=fn, one_token=one_token)
        Bt, N, _ = x.shape
        H, P, G, Ns, I = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size, self.intermediate_size
        check_state(state, B=Bt, conv=(self.conv_dim, self.conv_kernel_size - 1), rec=(H, Ns, P), fn=fn)
        x = mask_padding(x, attention_mask, fn=fn)
        z, xBC, dt = self.in_proj(x).split([I, self.conv_dim, H], dim=-1)
        xBC, conv = causal_conv(xBC, self.conv1d.weight, self.conv1d.bias, None if state is None else state.conv)
        xBC = mask_padding(xBC, attention_mask, fn=fn)  # the convolution's bias would otherwise write padding
        xs, Bm, Cm = xBC.split([I, G * Ns, G * Ns], dim=-1)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        dt = F.softplus(dt.to(work) + self.dt_bias.to(work)).clamp(*self.time_step_limit)  # (B, N, H)
        A = -self.A_log.to(work).exp()
        xs_h = xs.reshape(Bt, N, H, P).transpose(1, 2)  # (B, H, N, P)
        q = Cm.reshape(Bt, N, G, Ns).transpose(1, 2)  # (B, G, N, Ns)
        k = Bm.reshape(Bt, N, G, Ns).transpose(1, 2)
        v = xs_h * dt.transpose(1, 2).unsqueeze(-1).to(xs_h.dtype)
        g = (dt * A).transpose(1, 2)  # (B, H, N), float32 (float64 for float64 inputs)
        rec = None if state is None else state.recurrent
        if one_token:
            y, rec = gated_linear_step(q, k, v, g, rec)
        else:
            y, rec = gated_linear_chunked(q, k, v, g, chunk_size=self.chunk_size, initial_state=rec)
        y = y + self.D.to(y.dtype)[:, None, None] * xs_h
        y = self.norm(y.transpose(1, 2).reshape(Bt, N, I), z)
        y = apply_head_gate(y.view(Bt, N, H, P).transpose(1, 2), self.head_gate).transpose(1, 2).reshape(Bt, N, I)
        return LinearAttentionOutput(self.out_proj(y), RecurrentState(conv, rec))

    def forward(self, x: torch.Tensor, *, state: RecurrentState | None = None,
                attention_mask: torch.Tensor | None = None) -> LinearAttentionOutput:
        """Mix a whole sequence by the chunked SSD (gated linear rule).

        Args:
            x: ``(B, N, E)``.
            state: ``RecurrentState`` (conv ``(B, I + 2 G Ns, K - 1)``, recurrent ``(B, H, Ns, P)``) or ``None``.
            attention_mask: ``(B, N)``, 1 for real tokens and 0 for padding, or ``None``.

        Returns:
            ``LinearAttentionOutput(out (B, N, E), RecurrentState after the last token)``.
        """
        return self._mix(x, state, attention_mask, fn="Mamba2Mixer.forward", one_token=False)

    def step(self, x: torch.Tensor, state: RecurrentState | None) -> LinearAttentionOutput:
        """Decode one token ``x`` (B, 1, E) from ``state``; returns ``LinearAttentionOutput(out, state)``."""
        return self._mix(x, state, None, fn="Mamba2Mixer.step", one_token=True)

    def cache_spec(self) -> RecurrentSpec:
        """What a :class:`qkv.cache.KVCache` keeps for this layer: the convolution's inputs and the state."""
        return RecurrentSpec(self.conv_dim, self.conv_kernel_size, self.num_heads, self.ssm_state_size, self.head_dim)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"state_size={self.ssm_state_size}, n_groups={self.n_groups}, conv_kernel={self.conv_kernel_size}")
