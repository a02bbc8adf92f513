"""``LinearAttention``: multi-head self-attention with a feature map instead of softmax.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention", ICML 2020 (arXiv:2006.16236).

The module owns the q/k/v/o projections; the math is ``qkv.linear.linear_attention_chunked`` (whole
sequences) and ``qkv.linear.linear_attention_step`` (one token of decoding). The recurrent state is
explicit: ``forward`` and ``step`` take a ``LinearState`` and return the next one.

Shape legend: B batch, N tokens, E model dim (``d_model``), H heads, Dh head dim (``E // H``).
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.linear._common import DEFAULT_EPS, LinearAttentionOutput, LinearState
from qkv.linear.chunk import DEFAULT_CHUNK_SIZE, linear_attention_chunked
from qkv.linear.feature_maps import FeatureMap, resolve_feature_map
from qkv.linear.recurrent import linear_attention_step
from qkv.nn._heads import add_projections, check_dims, check_x, merge_heads, split_heads

__all__ = ["LinearAttention"]


class LinearAttention(nn.Module):
    """Multi-head linear self-attention: ``phi(Q) (phi(K)^T V)``, causal or not, with explicit state.

    Args:
        d_model: E, model width; must be divisible by ``n_heads``.
        n_heads: H.
        feature_map: ``"elu_plus_one"`` (default), ``"relu"`` or a callable ``phi(x_BHND) -> x_BHNF``.
        causal: token ``i`` attends to tokens ``<= i`` (needed for ``step``).
        normalize: divide by ``phi(q)^T z + eps`` (the paper's form); ``False`` drops the normalizer.
        eps: absolute guard on the normalizer.
        chunk_size: tokens per chunk in the causal prefill.
        bias: bias in the four projections.
        layer_idx: this layer's index among the model's layers.
        device, dtype: for the parameters.

    Example:
        >>> import torch
        >>> attn = LinearAttention(32, 4, causal=True)
        >>> x = torch.randn(2, 10, 32)
        >>> out, state = attn(x[:, :9])
        >>> y, state = attn.step(x[:, 9:], state)        # decode token 9 from the state
        >>> torch.allclose(y, attn(x).out[:, 9:], atol=1e-5)
        True
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        feature_map: str | FeatureMap = "elu_plus_one",
        causal: bool = False,
        normalize: bool = True,
        eps: float = DEFAULT_EPS,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        bias: bool = True,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_dims("LinearAttention", d_model, n_heads)
        if feature_map is None:
            raise ValueError("LinearAttention: feature_map must be a name or a callable, got None")
        self.phi = resolve_feature_map(feature_map)
        self.d_model, self.n_heads = d_model, n_heads
        self.causal, self.normalize, self.eps, self.chunk_size = causal, normalize, eps, chunk_size
        add_projections(self, d_model, bias=bias, device=device, dtype=dtype)
        self.layer_idx = layer_idx
        self.head_gate: torch.Tensor | None = None  # (H,) multiplier of each head's output; None: 1

    @property
    def attention_fn(self) -> None:
        """None: there is no softmax operator call to hook (a feature map replaces softmax attention), so tools
        that replace the operator (capture, packed documents, context parallelism) refuse this module
        (:class:`qkv.nn.protocol.AttentionModule`)."""
        return None

    @property
    def n_kv_heads(self) -> int:
        """``n_heads``: every head has its own keys and values."""
        return self.n_heads

    def forward(self, x: torch.Tensor, *, state: LinearState | None = None) -> LinearAttentionOutput:
        """Attend over a whole sequence.

        Args:
            x: ``(B, N, E)``.
            state: ``LinearState(S (B, H, F, Dh), z (B, H, F))`` left by earlier tokens, or ``None``.

        Returns:
            ``LinearAttentionOutput(out (B, N, E) in x's dtype, state after the last token)``.
        """
        check_x(x, self.d_model, fn="LinearAttention.forward")
        q, k, v = split_heads(self, x, self.n_heads)
        out, new_state = linear_attention_chunked(
            q, k, v, feature_map=self.phi, causal=self.causal, normalize=self.normalize, eps=self.eps,
            chunk_size=self.chunk_size, initial_state=state,
        )
        return LinearAttentionOutput(merge_heads(self, out), new_state)

    def step(self, x: torch.Tensor, state: LinearState | None) -> LinearAttentionOutput:
        """Decode one token in O(F Dh) per head, whatever the context length.

        Args:
            x: ``(B, 1, E)``, the new token.
            state: from ``forward`` or an earlier ``step``; ``None`` for the first token.

        Returns:
            ``LinearAttentionOutput(out (B, 1, E), state including this token)``.
        """
        if not self.causal:
            raise ValueError("LinearAttention.step decodes causally; build the module with causal=True")
        check_x(x, self.d_model, fn="LinearAttention.step", one_token=True)
        q, k, v = split_heads(self, x, self.n_heads)
        out, new_state = linear_attention_step(q, k, v, state, feature_map=self.phi, normalize=self.normalize,
                                               eps=self.eps)
        return LinearAttentionOutput(merge_heads(self, out), new_state)

    def extra_repr(self) -> str:
        name = getattr(self.phi, "__name__", repr(self.phi))
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, feature_map={name}, causal={self.causal}, "
                f"normalize={self.normalize}, chunk_size={self.chunk_size}")
