"""``GatedDeltaNet``: the Gated DeltaNet mixer of Qwen3-Next and Qwen3.5, parameters named as HF's
``Qwen3NextGatedDeltaNet`` so its weights load by name.

Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025
(arXiv:2412.06464). Per token ``x`` (B, N, E)::

    q, k, v, z = in_proj_qkvz(x)     grouped per key head: [q (Dk), k (Dk), v (r Dv), z (r Dv)], r = H / Hk
    b, a       = in_proj_ba(x)        grouped per key head: [b (r), a (r)]
    q, k, v    = silu(causal depthwise conv_K([q, k, v]))          the short convolution
    q, k       = l2norm(q) * Dk^-0.5, l2norm(k)
    beta       = sigmoid(b)                                        the write strength (2 sigmoid(b) with
                                                                   allow_neg_eigval: OLMo-hybrid)
    g          = -exp(A_log) * softplus(a + dt_bias)               one log-decay per value head
    o          = gated_delta(q, k, v, g, beta)                     qkv.linear.gated_delta_chunked / _step
    y          = out_proj(rms_norm(o) * norm.weight * silu(z))     per value head

The math is :func:`qkv.linear.gated_delta_chunked` (whole sequences) and :func:`qkv.linear.gated_delta_step`
(one token); the module owns the weights and the state, :class:`qkv.nn.RecurrentState` (the convolution's last
``K - 1`` inputs and the ``(Dk, Dv)`` state per value head), which ``forward`` and ``step`` take and return.

Shape legend: B batch, N tokens, E hidden size, Hk key heads, H value heads, Dk key head dim, Dv value head dim,
K convolution taps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.cache.specs import RecurrentSpec
from qkv.config.decoder import DecoderConfig
from qkv.linear import LinearAttentionOutput
from qkv.nn._recurrent import DeltaKernel, RecurrentState, check_input, check_state, delta_mix, mask_padding
from qkv.nn.mixer import MixerStep, mix_recurrent
from qkv.nn.norm import NormKernel
from qkv.nn.protocol import apply_head_gate

__all__ = ["GatedDeltaNet", "SplitGatedDeltaNet", "GatedRMSNorm", "gated_rms_norm"]


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, *, eps: float,
                   activation=F.silu, norm_kernel: NormKernel | None = None) -> torch.Tensor:
    """``rms_norm(x) * weight * activation(gate)`` over the last dim (norm before gate), in float32 for
    low-precision inputs; ``norm_kernel`` (see :class:`qkv.nn.RMSNorm`) is tried for the norm of float32/float64
    inputs."""
    if x.dtype in (torch.float32, torch.float64) and weight.dtype == gate.dtype == x.dtype:  # fused: 3 ops, not 8
        y = None if norm_kernel is None else norm_kernel(x, weight, eps, 0.0)
        return (F.rms_norm(x, weight.shape, weight, eps) if y is None else y) * activation(gate)
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    xw = x.to(work)
    y = xw * torch.rsqrt(xw.square().mean(-1, keepdim=True) + eps) * weight.to(work)
    return (y * activation(gate.to(work))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * activation(gate)`` over the last dim: SiLU in Gated DeltaNet, sigmoid in KDA."""

    def __init__(self, dim: int, *, eps: float = 1e-6, activation: str = "silu", device=None, dtype=None) -> None:
        super().__init__()
        if activation not in _GATES:
            raise ValueError(f"GatedRMSNorm: activation must be one of {sorted(_GATES)}, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.norm_kernel: NormKernel | None = None  # qkv.cpu.optimize puts its compiled loop here

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, self.weight, gate, eps=self.eps, activation=_GATES[self.activation],
                              norm_kernel=self.norm_kernel)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"


_GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer with a short convolution, as in Qwen3-Next's linear-attention layers.

    Args:
        hidden_size: E.
        num_k_heads: Hk, query/key heads (``linear_num_key_heads``).
        num_v_heads: H, value heads (``linear_num_value_heads``), a multiple of Hk.
        head_k_dim: Dk (``linear_key_head_dim``).
        head_v_dim: Dv (``linear_value_head_dim``).
        conv_kernel_size: K (``linear_conv_kernel_dim``).
        norm_eps: epsilon of the gated output norm (``rms_norm_eps``).
        allow_neg_eigval: ``beta = 2 sigmoid(b)`` in ``[0, 2]``: the transition ``I - beta k k^T`` may have a
            negative eigenvalue (Grazzi et al. 2025, arXiv:2411.12537; OLMo-hybrid's ``linear_allow_neg_eigval``).
        chunk_size: tokens per chunk of the prefill; ``None`` lets the chunked form choose for its path.
        layer_idx: this layer's index among the model's layers (and in a KV cache).
        device, dtype: for the parameters.

    Example:
        >>> import torch
        >>> layer = GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
        >>> x = torch.randn(2, 10, 32)
        >>> out, state = layer(x[:, :9])
        >>> y, state = layer.step(x[:, 9:], state)          # decode token 9 from the state
        >>> torch.allclose(y, layer(x).out[:, 9:], atol=1e-5)
        True
    """

    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, norm_eps: float = 1e-6, chunk_size: int | None = None,
                 layer_idx: int = 0, allow_neg_eigval: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                          ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim),
                          ("conv_kernel_size", conv_kernel_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"GatedDeltaNet: {name} must be a positive int, got {val!r}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"GatedDeltaNet: num_v_heads={num_v_heads} must be a multiple of num_k_heads="
                             f"{num_k_heads} (each key head serves num_v_heads // num_k_heads value heads)")
        if not isinstance(allow_neg_eigval, bool):
            raise TypeError(f"GatedDeltaNet: allow_neg_eigval must be True or False, got {allow_neg_eigval!r}")
        self.allow_neg_eigval = allow_neg_eigval
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_k_heads, self.num_v_heads = hidden_size, num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_kernel_size = head_k_dim, head_v_dim, conv_kernel_size
        self.norm_eps, self.chunk_size = norm_eps, chunk_size
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
                                padding=conv_kernel_size - 1, **kw)
        self.delta_kernel: DeltaKernel | None = None  # qkv.cpu.optimize puts the compiled gated delta rule here
        self._add_projections(kw)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads, **kw).uniform_(1, 16)))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, **kw)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = num_v_heads, num_k_heads  # value heads read key heads, as GQA's
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1

    @property
    def attention_fn(self) -> None:
        """None: a recurrent mixer makes no softmax operator call to hook, so tools that replace the operator
        (capture, packed documents, context parallelism) refuse it (:class:`qkv.nn.protocol.AttentionModule`)."""
        return None

    def _add_projections(self, kw: dict) -> None:
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False, **kw)

    def _project(self, x: torch.Tensor):
        """``(q, k, v)`` flat ``(B, N, key_dim | value_dim)`` for the convolution, ``z`` (B, N, H, Dv), ``b, a``
        (B, N, H), from Qwen3-Next's projections grouped per key head."""
        B, N, _ = x.shape
        Hk, H, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        r = H // Hk
        qkvz = self.in_proj_qkvz(x).view(B, N, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, N, Hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, N, -1), k.reshape(B, N, -1), v.reshape(B, N, -1)], dim=-1)
        return mixed, z.reshape(B, N, H, Dv), b.reshape(B, N, H), a.reshape(B, N, H)

    def _mix(self, x: torch.Tensor, state: RecurrentState | None, attention_mask, *, fn: str, one_token: bool):
        check_input(x, self.hidden_size, fn=fn, one_token=one_token)
        B, N, _ = x.shape
        Hk, H, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        check_state(state, B=B, conv=(self.conv_dim, self.conv_kernel_size - 1), rec=(H, Dk, Dv), fn=fn)
        x = mask_padding(x, attention_mask, fn=fn)
        mixed, z, b, a = self._project(x)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        beta = b.to(work).sigmoid().transpose(1, 2)  # (B, H, N) in [0, 1]
        if self.allow_neg_eigval:
            beta = 2 * beta  # in [0, 2]: I - beta k k^T may flip the sign along k
        g = -self.A_log.to(work).exp() * F.softplus(a.to(work) + self.dt_bias.to(work))
        g = g.transpose(1, 2)  # (B, H, N)
        o, new_state = delta_mix(mixed, self.conv1d.weight, g, beta, state, Hk=Hk, Dk=Dk, Dv=Dv,
                                 chunk_size=self.chunk_size, one_token=one_token,
                                 kernel=self.delta_kernel)  # g, beta stay in float32
        o = self.norm(o.transpose(1, 2), z)  # (B, N, H, Dv)
        o = apply_head_gate(o.transpose(1, 2), self.head_gate).transpose(1, 2)
        return LinearAttentionOutput(self.out_proj(o.reshape(B, N, H * Dv)), new_state)

    def forward(self, x: torch.Tensor, *, state: RecurrentState | None = None,
                attention_mask: torch.Tensor | None = None) -> LinearAttentionOutput:
        """Mix a whole sequence (a prompt, or more tokens after ``state``) by the chunked gated delta rule.

        Args:
            x: ``(B, N, E)``.
            state: ``RecurrentState`` left by earlier tokens, or ``None`` for a fresh sequence.
            attention_mask: ``(B, N)``, 1 for real tokens and 0 for padding (zeroed before the projections, as
                HF does, so left padding leaves the state as the real tokens alone would), or ``None``.

        Returns:
            ``LinearAttentionOutput(out (B, N, E), RecurrentState after the last token)``.
        """
        return self._mix(x, state, attention_mask, fn="GatedDeltaNet.forward", one_token=False)

    def step(self, x: torch.Tensor, state: RecurrentState | None) -> LinearAttentionOutput:
        """Decode one token in O(H Dk Dv), whatever the context length.

        Args:
            x: ``(B, 1, E)``.
            state: from ``forward`` or an earlier ``step``; ``None`` for the first token.

        Returns:
            ``LinearAttentionOutput(out (B, 1, E), state including this token)``.
        """
        return self._mix(x, state, None, fn="GatedDeltaNet.step", one_token=True)

    def cache_spec(self) -> RecurrentSpec:
        """What a :class:`qkv.cache.KVCache` keeps for this layer: the convolution's inputs and the state."""
        return RecurrentSpec(self.conv_dim, self.conv_kernel_size, self.num_v_heads, self.head_k_dim, self.head_v_dim)

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope=None) -> GatedDeltaNet:
        """The mixer of ``linear_attention`` layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`)."""
        lin = config.linear_attention
        return cls(config.hidden_size, num_k_heads=lin.linear_num_key_heads, num_v_heads=lin.linear_num_value_heads,
                   head_k_dim=lin.linear_key_head_dim, head_v_dim=lin.linear_value_head_dim,
                   conv_kernel_size=lin.linear_conv_kernel_dim,
                   norm_eps=config.rms_norm_eps if lin.norm_eps is None else lin.norm_eps, layer_idx=layer_idx,
                   allow_neg_eigval=lin.allow_neg_eigval)

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """The decoder's call (:class:`qkv.nn.mixer.DecoderMixer`): every column goes through the cached state."""
        return mix_recurrent(self, x, step)

    def score_modifiers(self) -> tuple:
        return ()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_k_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, conv_kernel_size={self.conv_kernel_size}"
                + (", allow_neg_eigval" if self.allow_neg_eigval else ""))


class SplitGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3.5's projections: ``in_proj_qkv`` (q, k, v one after the other, as the convolution
    takes them), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, each flat over heads (HF's
    ``Qwen3_5GatedDeltaNet``); everything else as :class:`GatedDeltaNet`.

    Example:
        >>> import torch
        >>> layer = SplitGatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
        >>> sorted(n for n, _ in layer.named_parameters() if n.startswith("in_proj"))
        ['in_proj_a.weight', 'in_proj_b.weight', 'in_proj_qkv.weight', 'in_proj_z.weight']
    """

    def _add_projections(self, kw: dict) -> None:
        E, H = self.hidden_size, self.num_v_heads
        self.in_proj_qkv = nn.Linear(E, 2 * self.key_dim + self.value_dim, bias=False, **kw)
        self.in_proj_z = nn.Linear(E, self.value_dim, bias=False, **kw)
        self.in_proj_b = nn.Linear(E, H, bias=False, **kw)
        self.in_proj_a = nn.Linear(E, H, bias=False, **kw)

    def _project(self, x: torch.Tensor):
        B, N, _ = x.shape
        z = self.in_proj_z(x).view(B, N, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
