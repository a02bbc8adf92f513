"""Linear attention and Performer FAVOR+: attention as a recurrence over a fixed-size state.

Katharopoulos et al., "Transformers are RNNs", ICML 2020 (arXiv:2006.16236); Choromanski et al.,
"Rethinking Attention with Performers", ICLR 2021 (arXiv:2009.14794).

One semantics, four forms that agree (tested against each other in float64)::

    linear_attention_parallel    masked (N, N) product; the reference (naive.py)
    linear_attention_chunked     chunkwise-parallel; the fast one for whole sequences (chunk.py)
    linear_attention_recurrent   a loop over tokens carrying LinearState(S, z) (recurrent.py)
    linear_attention_step        one token in, state in and out: decoding (recurrent.py)

Gated rules (Gated Linear Attention, Mamba2's SSD, Gated DeltaNet, Kimi Delta Attention), the same four
forms each, the state a tensor ``(B, H, Dk, Dv)``::

    gated_linear_*:  S_t = exp(g_t) * S_{t-1} + k_t v_t^T
    gated_delta_*:   S_t = (I - beta_t k_t k_t^T)(exp(g_t) * S_{t-1}) + beta_t k_t v_t^T
    both:            o_t = S_t^T q_t      (* in parallel, chunked, recurrent, step)

Every form takes ``initial_state`` (or ``state``) and returns ``LinearAttentionOutput(out, state)``;
splitting a causal sequence anywhere and carrying the state gives the one-call result.

Example:
    >>> import torch
    >>> from qkv.linear import linear_attention_chunked, linear_attention_step
    >>> q, k, v = torch.randn(3, 1, 2, 9, 16).unbind(0)
    >>> out, state = linear_attention_chunked(q[:, :, :8], k[:, :, :8], v[:, :, :8], causal=True)
    >>> y, state = linear_attention_step(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], state)
    >>> y.shape, state.S.shape
    (torch.Size([1, 2, 1, 16]), torch.Size([1, 2, 16, 16]))
"""

from qkv.linear._common import DEFAULT_EPS, LinearAttentionOutput, LinearState
from qkv.linear.chunk import DEFAULT_CHUNK_SIZE, linear_attention_chunked
from qkv.linear.feature_maps import FEATURE_MAPS, FeatureMap, elu_plus_one, relu, resolve_feature_map
from qkv.linear.gated_chunk import DEFAULT_GATED_CHUNK_SIZE, gated_delta_chunked, gated_linear_chunked
from qkv.linear.gated_naive import gated_delta_parallel, gated_linear_parallel
from qkv.linear.gated_recurrent import (
    gated_delta_recurrent,
    gated_delta_step,
    gated_linear_recurrent,
    gated_linear_step,
)
from qkv.linear.naive import linear_attention_parallel
from qkv.linear.performer import (
    PERFORMER_EPS,
    default_num_features,
    favor_key_features,
    favor_query_features,
    orthogonal_gaussian,
    performer_attention,
    performer_attention_step,
)
from qkv.linear.recurrent import linear_attention_recurrent, linear_attention_step

__all__ = [
    "LinearState",
    "LinearAttentionOutput",
    "FeatureMap",
    "FEATURE_MAPS",
    "DEFAULT_EPS",
    "DEFAULT_CHUNK_SIZE",
    "PERFORMER_EPS",
    "elu_plus_one",
    "relu",
    "resolve_feature_map",
    "linear_attention_parallel",
    "linear_attention_chunked",
    "linear_attention_recurrent",
    "linear_attention_step",
    "default_num_features",
    "orthogonal_gaussian",
    "favor_query_features",
    "favor_key_features",
    "performer_attention",
    "performer_attention_step",
    "DEFAULT_GATED_CHUNK_SIZE",
    "gated_linear_parallel",
    "gated_linear_chunked",
    "gated_linear_recurrent",
    "gated_linear_step",
    "gated_delta_parallel",
    "gated_delta_chunked",
    "gated_delta_recurrent",
    "gated_delta_step",
]
