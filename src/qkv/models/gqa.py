"""Multi-head checkpoints to grouped-query (GQA) or multi-query (MQA) attention by pooling key/value heads.

Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints" (arXiv:2305.13245), Sec. 2.1: to convert a checkpoint with ``Hkv`` key/value heads into one
with ``G`` (``Hkv % G == 0``), each new key (value) head's projection is the mean of the ``Hkv / G`` original
key (value) projection heads of its group, biases included; the query and output projections are kept.
Query head ``h`` then reads new head ``h // (Hq / G)``, which pools exactly the original heads the queries of
that group read, so a model whose heads in each group are already equal is unchanged. The paper found mean
pooling better than keeping the first head of each group (also offered, ``pooling="first"``) or random
initialization, followed by a short uptraining (5% of pre-training) to recover quality. RoPE rotates keys
after the projection and is linear, so pooling before it equals pooling after it.

The converted model's KV cache is ``Hkv / G`` times smaller (``model.cache_specs()`` where it has one).

Supported: every :class:`qkv.nn.MultiHeadAttention` (BERT-family encoders, GPT-2, BLOOM, T5 self and
cross attention) and the fused-QKV attention of :class:`qkv.nn.DecoderLM` (Llama, Mistral,
Qwen2, Gemma 2/3). Multi-head latent attention (DeepSeek-V2) caches a latent, not per-head keys: refused.

Example:
    >>> import torch
    >>> from qkv.nn import DecoderConfig, DecoderLM
    >>> lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                              intermediate_size=64))
    >>> mqa = to_gqa(lm, 1)
    >>> mqa.config.num_key_value_heads, mqa(torch.randint(0, 50, (1, 5))).logits.shape
    (1, torch.Size([1, 5, 50]))
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..config.decoder import DecoderConfig, TransformerConfig
from ..cpu.skinny import SkinnyLinear
from ..nn.attention import MultiHeadAttention
from ..nn.decoder import SelfAttention
from ..nn.latent import LatentAttention
from ..nn.protocol import attention_modules

__all__ = ["POOLINGS", "pool_heads", "to_gqa"]

POOLINGS = ("mean", "first")


def pool_heads(t: torch.Tensor, num_heads: int, num_groups: int, *, pooling: str = "mean") -> torch.Tensor:
    """Pool the ``num_heads`` head blocks of a projection's output rows into ``num_groups`` heads.

    Args:
        t: a weight ``(num_heads * D, in)`` or a bias ``(num_heads * D,)``; heads are consecutive row blocks.
        num_heads: heads in ``t``; ``num_groups`` must divide it. Group ``j`` holds heads
            ``j * r .. (j + 1) * r - 1`` with ``r = num_heads // num_groups``.
        pooling: ``"mean"`` (Ainslie et al.) or ``"first"`` (keep the first head of each group).

    Returns:
        ``(num_groups * D, in)`` or ``(num_groups * D,)``, same dtype and device.

    Example:
        >>> w = torch.arange(8.0).view(4, 2)  # 4 heads of width 1
        >>> pool_heads(w, 4, 2).tolist(), pool_heads(w, 4, 2, pooling="first").tolist()
        ([[1.0, 2.0], [5.0, 6.0]], [[0.0, 1.0], [4.0, 5.0]])
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pool_heads: pooling must be one of {POOLINGS}, got {pooling!r}")
    if num_groups <= 0 or num_heads % num_groups or t.shape[0] % num_heads:
        raise ValueError(f"pool_heads: {num_heads} heads over {t.shape[0]} rows cannot form {num_groups} equal groups; "
                         "num_groups must divide num_heads and num_heads the rows")
    r = num_heads // num_groups
    grouped = t.reshape(num_groups, r, t.shape[0] // num_heads, *t.shape[1:])  # (G, r, D, ...)
    out = grouped.mean(dim=1) if pooling == "mean" else grouped[:, 0]
    return out.reshape(-1, *t.shape[1:]).contiguous()


def _linear_like(old: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A linear layer of ``old``'s kind (plain, skinny or input-major) holding ``weight`` and ``bias``."""
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    new.weight.requires_grad_(old.weight.requires_grad)
    if isinstance(old, SkinnyLinear):
        new = type(old).from_linear(new)
    return new


def _check_groups(name: str, n_heads: int, n_kv: int, g: int) -> None:
    if n_kv % g or n_heads % g:
        raise ValueError(f"to_gqa: {name} has {n_heads} query heads and {n_kv} key/value heads; num_kv_heads={g} "
                         f"must divide both (choose a divisor of {n_kv})")


def _convert_mha(name: str, m: MultiHeadAttention, g: int, pooling: str) -> None:
    _check_groups(name, m.n_heads, m.n_kv_heads, g)
    with torch.no_grad():
        for proj in ("k_proj", "v_proj"):
            old = getattr(m, proj)
            w = pool_heads(old.weight.detach(), m.n_kv_heads, g, pooling=pooling)
            b = None if old.bias is None else pool_heads(old.bias.detach(), m.n_kv_heads, g, pooling=pooling)
            setattr(m, proj, _linear_like(old, w, b))
    m.n_kv_heads = g
    m.invalidate_fused_weights()


def _convert_fused(name: str, m: SelfAttention, g: int, pooling: str) -> None:
    Hq, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    _check_groups(name, Hq, Hkv, g)
    old = m.qkv_proj
    sizes = (Hq * D, Hkv * D, Hkv * D)
    with torch.no_grad():
        wq, wk, wv = old.weight.detach().split(sizes)
        w = torch.cat([wq, pool_heads(wk, Hkv, g, pooling=pooling), pool_heads(wv, Hkv, g, pooling=pooling)])
        b = None
        if old.bias is not None:
            bq, bk, bv = old.bias.detach().split(sizes)
            b = torch.cat([bq, pool_heads(bk, Hkv, g, pooling=pooling), pool_heads(bv, Hkv, g, pooling=pooling)])
    m.qkv_proj = _linear_like(old, w, b)
    m.n_kv_heads = g


def _new_config(config, g: int):
    if isinstance(config, DecoderConfig):
        return config.replace(num_key_value_heads=g)
    if isinstance(config, TransformerConfig):
        return config.replace(n_kv_heads=g)
    return config


def to_gqa(model: nn.Module, num_kv_heads: int, *, pooling: str = "mean") -> nn.Module:
    """A copy of ``model`` whose attention layers have ``num_kv_heads`` key/value heads (mean-pooled groups).

    Args:
        model: a qkv model (``qkv.models.from_hf`` output, a :class:`qkv.nn.DecoderLM`, a
            :class:`qkv.nn.DecoderLM`/encoder, a :class:`qkv.models.embed.SentenceEncoder`'s model, ...)
            holding :class:`qkv.nn.MultiHeadAttention` or fused-QKV decoder attention. Left unchanged.
        num_kv_heads: key/value heads after conversion, ``1`` for MQA; must divide every layer's query and
            key/value head counts.
        pooling: ``"mean"`` (Ainslie et al. 2023) or ``"first"`` (keep the first head of each group).

    Returns:
        The converted copy, in eval/train mode as ``model`` was; configs it holds say ``num_kv_heads``.

    Raises:
        ValueError: bad ``num_kv_heads`` or ``pooling``; latent attention (MLA) or another attention module
            (:class:`qkv.nn.protocol.AttentionModule`) whose heads it cannot pool; a model without attention
            modules.

    Example:
        >>> import torch
        >>> from qkv.nn import MultiHeadAttention
        >>> attn = MultiHeadAttention(32, 8)
        >>> to_gqa(attn, 2).k_proj.weight.shape
        torch.Size([8, 32])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_gqa: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(num_kv_heads, int) or isinstance(num_kv_heads, bool) or num_kv_heads <= 0:
        raise ValueError(f"to_gqa: num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if pooling not in POOLINGS:
        raise ValueError(f"to_gqa: pooling must be one of {POOLINGS}, got {pooling!r}")
    targets = attention_modules(model)
    if not targets:
        raise ValueError(f"to_gqa: no attention module qkv can convert in {type(model).__name__} (expected "
                         "qkv.nn.MultiHeadAttention or the fused attention of qkv.nn.DecoderLM)")
    for name, m in targets:  # check every layer before copying anything
        if isinstance(m, LatentAttention):
            raise ValueError(f"to_gqa: {name or 'the model'} is multi-head latent attention (MLA), which caches a "
                             "shared latent rather than per-head keys and values; there are no heads to pool")
        if not isinstance(m, (MultiHeadAttention, SelfAttention)):
            raise ValueError(f"to_gqa: {name or 'the model'} is {type(m).__name__}, whose key/value heads to_gqa "
                             "cannot pool (it converts qkv.nn.MultiHeadAttention and the fused attention of "
                             "qkv.nn.DecoderLM); convert the model's other attention modules one by one")
        _check_groups(name or "the model", m.n_heads, m.n_kv_heads, num_kv_heads)
    new = copy.deepcopy(model)
    for name, m in attention_modules(new):
        if isinstance(m, MultiHeadAttention):
            _convert_mha(name, m, num_kv_heads, pooling)
        else:
            _convert_fused(name, m, num_kv_heads, pooling)
    configs: dict[int, object] = {}
    for m in new.modules():
        config = getattr(m, "config", None)
        if isinstance(config, (DecoderConfig, TransformerConfig)):
            if id(config) not in configs:
                configs[id(config)] = _new_config(config, num_kv_heads)
            m.config = configs[id(config)]
    return new
