"""A small self-contained decoder that follows the cache protocol, for cache and generate tests.

Per layer: RMSNorm, attention, RMSNorm, a GELU MLP, pre-norm residuals. Attention layers are one of

- ``"full"``: GQA with RoPE; keys are passed un-rotated with ``rope=`` so caches choose positions;
- ``"window"``: the same with a sliding window of ``W`` keys (the query included);
- ``"latent"``: MLA in its expanded form (DeepSeek-V2): a latent ``c_kv`` and a shared RoPE key are
  cached through ``cache.update_latent``; per-head keys/values are expanded from the latent each step.

Masks are built only from positions (``masks.positions``), so the model never assumes slot order.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv
from qkv import masks
from qkv.cache import FullSpec, LatentSpec, SlidingWindowSpec


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny ops run fastest on one thread, and two xdist workers with several threads each on a busy 2-core
    machine spin-wait for minutes: cache tests pin torch to one thread and restore it afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE: x (B, H, N, D), positions (B, N) or (N,) (negative ones act as 0)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)  # (D/2,)
    pos = positions.clamp_min(0).to(torch.float64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    ang = pos.unsqueeze(-1) * inv  # (B, N, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(1).to(x.dtype)  # (B, 1, N, D)
    sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None, idx: int) -> None:
        super().__init__()
        self.H, self.Hkv, self.D, self.window, self.idx = n_heads, n_kv_heads, head_dim, window, idx
        self.q = nn.Linear(d, n_heads * head_dim, bias=False)
        self.k = nn.Linear(d, n_kv_heads * head_dim, bias=False)
        self.v = nn.Linear(d, n_kv_heads * head_dim, bias=False)
        self.o = nn.Linear(n_heads * head_dim, d, bias=False)

    def spec(self):
        if self.window is None:
            return FullSpec(self.Hkv, self.D)
        return SlidingWindowSpec(self.window, self.Hkv, self.D)

    def forward(self, x, positions, cache):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.H, self.D).transpose(1, 2)  # (B, H, N, D)
        k = self.k(x).view(B, N, self.Hkv, self.D).transpose(1, 2)  # (B, Hkv, N, D)
        v = self.v(x).view(B, N, self.Hkv, self.D).transpose(1, 2)
        if cache is not None:
            view = cache.update(self.idx, k, v, positions=positions, rope=rope)
            k, v, kv_pos, q_pos = view
        else:
            k, kv_pos, q_pos = rope(k, positions), positions, positions
        q = rope(q, q_pos)
        mask = masks.positions(q_pos, kv_pos, causal=True, window=self.window)
        out = qkv.attention(q, k, v, mask=mask)
        if cache is not None and hasattr(cache, "observe"):
            cache.observe(self.idx, q)
        return self.o(out.transpose(1, 2).reshape(B, N, self.H * self.D))


class LatentAttention(nn.Module):
    """MLA, expanded: k = [W_uk c_kv, k_rope], v = W_uv c_kv."""

    def __init__(self, d: int, n_heads: int, rank: int, nope_dim: int, rope_dim: int, v_dim: int, idx: int) -> None:
        super().__init__()
        self.H, self.r, self.dn, self.dr, self.dv, self.idx = n_heads, rank, nope_dim, rope_dim, v_dim, idx
        self.q = nn.Linear(d, n_heads * (nope_dim + rope_dim), bias=False)
        self.dkv = nn.Linear(d, rank, bias=False)
        self.kr = nn.Linear(d, rope_dim, bias=False)
        self.uk = nn.Linear(rank, n_heads * nope_dim, bias=False)
        self.uv = nn.Linear(rank, n_heads * v_dim, bias=False)
        self.o = nn.Linear(n_heads * v_dim, d, bias=False)

    def spec(self):
        return LatentSpec(self.r, self.dr)

    def forward(self, x, positions, cache):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.H, self.dn + self.dr).transpose(1, 2)  # (B, H, N, dn + dr)
        c_kv, k_r = self.dkv(x), self.kr(x)  # (B, N, r), (B, N, dr)
        if cache is not None:
            c_kv, k_r, kv_pos, q_pos = cache.update_latent(self.idx, c_kv, k_r, positions=positions, rope=rope)
        else:
            k_r, kv_pos, q_pos = rope(k_r.unsqueeze(1), positions).squeeze(1), positions, positions
        S = c_kv.shape[1]
        k_nope = self.uk(c_kv).view(B, S, self.H, self.dn).transpose(1, 2)  # (B, H, S, dn)
        k = torch.cat([k_nope, k_r.unsqueeze(1).expand(B, self.H, S, self.dr)], dim=-1)
        v = self.uv(c_kv).view(B, S, self.H, self.dv).transpose(1, 2)  # (B, H, S, dv)
        q = torch.cat([q[..., :self.dn], rope(q[..., self.dn:], q_pos)], dim=-1)
        out = qkv.attention(q, k, v, mask=masks.positions(q_pos, kv_pos, causal=True))
        return self.o(out.transpose(1, 2).reshape(B, N, self.H * self.dv))


class Block(nn.Module):
    def __init__(self, d: int, attn: nn.Module) -> None:
        super().__init__()
        self.n1, self.n2, self.attn = RMSNorm(d), RMSNorm(d), attn
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, positions, cache):
        x = x + self.attn(self.n1(x), positions, cache)
        return x + self.mlp(self.n2(x))


class ToyLM(nn.Module):
    """A DecoderModel. ``layers``: a list of ``"full"``, ``("window", W)`` or ``"latent"``."""

    def __init__(self, *, vocab: int = 61, d_model: int = 64, layers=("full", "full"), n_heads: int = 4,
                 n_kv_heads: int = 2, head_dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d_model)
        blocks = []
        for i, kind in enumerate(layers):
            if kind == "full":
                attn = Attention(d_model, n_heads, n_kv_heads, head_dim, None, i)
            elif kind == "latent":
                attn = LatentAttention(d_model, n_heads, rank=16, nope_dim=head_dim, rope_dim=8, v_dim=head_dim, idx=i)
            else:
                attn = Attention(d_model, n_heads, n_kv_heads, head_dim, kind[1], i)
            blocks.append(Block(d_model, attn))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        with torch.no_grad():  # larger logits make greedy choices decisive and errors visible
            self.head.weight.mul_(4.0)

    def cache_specs(self):
        return [b.attn.spec() for b in self.blocks]

    def forward(self, input_ids, *, positions=None, cache=None):
        B, N = input_ids.shape
        if positions is None:
            positions = torch.arange(N, device=input_ids.device).expand(B, N)
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x, positions, cache)
        return self.head(self.norm(x))


def peaked_decoder(seed: int, vocab_size: int, *, dtype=torch.float64, num_hidden_layers: int = 2, **fields):
    """A tiny qkv ``DecoderLM`` (width 32, 4 query / 2 KV heads) with unit-scale weights, so its logits are peaked
    and greedy choices do not hinge on rounding; ``fields`` override the DecoderConfig's."""
    from qkv.nn import DecoderConfig, DecoderLM

    torch.manual_seed(seed)
    base = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=64)
    model = DecoderLM(DecoderConfig(**{**base, **fields})).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[-1] ** -0.5 if "embed" not in name else 1.0)
    return model
