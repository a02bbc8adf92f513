"""``KimiDeltaAttention``: Kimi Linear's KDA mixer, parameters named as HF's ``KimiLinearDeltaAttention`` so its
weights load by name.

Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture", 2025 (arXiv:2510.26692): the gated
delta rule of Gated DeltaNet (Yang et al., ICLR 2025, arXiv:2412.06464) with one log-decay per key channel
instead of one per head. Per token ``x`` (B, N, E)::

    q, k, v = silu(causal depthwise conv_K([q_proj(x), k_proj(x), v_proj(x)]))
    q, k    = l2norm(q) * D^-0.5, l2norm(k)
    g       = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)    (B, H, N, D): per key channel
    beta    = sigmoid(b_proj(x))                                          (B, H, N)
    o       = gated_delta(q, k, v, g, beta)                               qkv.linear.gated_delta_chunked / _step
    y       = o_proj(rms_norm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))

The module owns the weights and a :class:`qkv.nn.RecurrentState`, which ``forward`` and ``step`` take and
return.

Shape legend: B batch, N tokens, E hidden size, H heads, D head dim (keys and values alike), K taps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.cache.specs import RecurrentSpec
from qkv.config.decoder import DecoderConfig
from qkv.linear import LinearAttentionOutput
from qkv.nn._recurrent import DeltaKernel, RecurrentState, check_input, check_state, delta_mix, mask_padding
from qkv.nn.gated_deltanet import GatedRMSNorm
from qkv.nn.mixer import MixerStep, mix_recurrent
from qkv.nn.protocol import apply_head_gate

__all__ = ["KimiDeltaAttention", "KimiForgetGate"]


class KimiForgetGate(nn.Module):
    """The per-channel log-decay ``-exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)``, (B, N, H, D)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim = num_heads, head_dim
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False, **kw)
        self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim, **kw))
        self.A_log = nn.Parameter(torch.log(torch.empty(1, 1, num_heads, 1, **kw).uniform_(1, 16)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        pre = self.f_b_proj(self.f_a_proj(x)).to(work) + self.dt_bias.to(work)
        B, N, _ = x.shape
        return -self.A_log.to(work).exp() * F.softplus(pre.view(B, N, self.num_heads, self.head_dim))


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention token mixer with a short convolution, as in Kimi Linear's KDA layers.

    Args:
        hidden_size: E.
        num_heads: H (``linear_num_heads``).
        head_dim: D (``linear_head_dim``).
        conv_kernel_size: K (``linear_conv_kernel_dim``).
        norm_eps: epsilon of the gated output norm (``rms_norm_eps``).
        chunk_size: tokens per chunk of the prefill; ``None`` lets the chunked form choose for its path.
        layer_idx: this layer's index among the model's layers (and in a KV cache).
        device, dtype: for the parameters.

    Example:
        >>> import torch
        >>> layer = KimiDeltaAttention(32, num_heads=2, head_dim=8)
        >>> x = torch.randn(2, 10, 32)
        >>> out, state = layer(x[:, :9])
        >>> y, state = layer.step(x[:, 9:], state)
        >>> torch.allclose(y, layer(x).out[:, 9:], atol=1e-5)
        True
    """

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 norm_eps: float = 1e-6, chunk_size: int | None = None, layer_idx: int = 0,
                 device=None, dtype=None) -> None:
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                          ("conv_kernel_size", conv_kernel_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"KimiDeltaAttention: {name} must be a positive int, got {val!r}")
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.conv_kernel_size, self.chunk_size = conv_kernel_size, chunk_size
        self.qkv_dim = num_heads * head_dim
        self.conv_dim = 3 * self.qkv_dim
        self.q_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False, **kw)
        self.k_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False, **kw)
        self.v_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
                                padding=conv_kernel_size - 1, **kw)
        self.delta_kernel: DeltaKernel | None = None  # qkv.cpu.optimize puts the compiled gated delta rule here
        self.forget_gate = KimiForgetGate(hidden_size, num_heads, head_dim, **kw)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False, **kw)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False, **kw)
        self.g_b_proj = nn.Linear(head_dim, self.qkv_dim, bias=False, **kw)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="sigmoid", **kw)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False, **kw)
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = num_heads, num_heads
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1

    @property
    def attention_fn(self) -> None:
        """None: a recurrent mixer makes no softmax operator call to hook, so tools that replace the operator
        (capture, packed documents, context parallelism) refuse it (:class:`qkv.nn.protocol.AttentionModule`)."""
        return None

    def _mix(self, x: torch.Tensor, state: RecurrentState | None, attention_mask, *, fn: str, one_token: bool):
        check_input(x, self.hidden_size, fn=fn, one_token=one_token)
        B, N, _ = x.shape
        H, D = self.num_heads, self.head_dim
        check_state(state, B=B, conv=(self.conv_dim, self.conv_kernel_size - 1), rec=(H, D, D), fn=fn)
        x = mask_padding(x, attention_mask, fn=fn)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.forget_gate(x).transpose(1, 2)  # (B, H, N, D), float32 (float64 for float64 inputs)
        beta = self.b_proj(x).sigmoid().transpose(1, 2)  # (B, H, N)
        o, new_state = delta_mix(mixed, self.conv1d.weight, g, beta, state, Hk=H, Dk=D, Dv=D,
                                 chunk_size=self.chunk_size, one_token=one_token,
                                 kernel=self.delta_kernel)
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, N, H, D)
        o = self.o_norm(o.transpose(1, 2), gate)  # (B, N, H, D)
        o = apply_head_gate(o.transpose(1, 2), self.head_gate).transpose(1, 2)
        return LinearAttentionOutput(self.o_proj(o.reshape(B, N, H * D)), new_state)

    def forward(self, x: torch.Tensor, *, state: RecurrentState | None = None,
                attention_mask: torch.Tensor | None = None) -> LinearAttentionOutput:
        """Mix a whole sequence by the chunked gated delta rule with per-channel decays.

        Args:
            x: ``(B, N, E)``.
            state: ``RecurrentState`` left by earlier tokens, or ``None``.
            attention_mask: ``(B, N)``, 1 for real tokens and 0 for padding (zeroed first, as HF does), or ``None``.

        Returns:
            ``LinearAttentionOutput(out (B, N, E), RecurrentState after the last token)``.
        """
        return self._mix(x, state, attention_mask, fn="KimiDeltaAttention.forward", one_token=False)

    def step(self, x: torch.Tensor, state: RecurrentState | None) -> LinearAttentionOutput:
        """Decode one token ``x`` (B, 1, E) from ``state``; returns ``LinearAttentionOutput(out, state)``."""
        return self._mix(x, state, None, fn="KimiDeltaAttention.step", one_token=True)

    def cache_spec(self) -> RecurrentSpec:
        """What a :class:`qkv.cache.KVCache` keeps for this layer: the convolution's inputs and the state."""
        return RecurrentSpec(self.conv_dim, self.conv_kernel_size, self.num_heads, self.head_dim, self.head_dim)

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope=None) -> KimiDeltaAttention:
        """The mixer of ``linear_attention`` layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`)."""
        lin = config.linear_attention
        return cls(config.hidden_size, num_heads=lin.linear_num_value_heads, head_dim=lin.linear_value_head_dim,
                   conv_kernel_size=lin.linear_conv_kernel_dim, norm_eps=config.rms_norm_eps, layer_idx=layer_idx)

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """The decoder's call (:class:`qkv.nn.mixer.DecoderMixer`): every column goes through the cached state."""
        return mix_recurrent(self, x, step)

    def score_modifiers(self) -> tuple:
        return ()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"conv_kernel_size={self.conv_kernel_size}")
