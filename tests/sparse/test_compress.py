"""qkv.sparse.compress_kv equals HF transformers' DeepSeek-V4 compressors (float64, random weights, with and without
their cache, in pieces), continues a sequence exactly through its carry, is differentiable, and refuses bad input.

HF computes the pooling weights with ``softmax(dtype=torch.float32)`` even for float64 inputs, so its float64 entries
carry float32 rounding (about 1e-7 here): the HF comparisons allow 1e-5; the exactness checks (pieces vs whole,
gradcheck) are float64-tight."""

from __future__ import annotations

import types

import pytest
import torch

from qkv.sparse import CompressCarry, compress_kv

M = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
HF_TOL = 1e-5  # HF's float32 pooling weights (see the module docstring)


def _hf_config(rate_csa=4, rate_hca=8):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(hidden_size=32, head_dim=16, num_attention_heads=4, q_lora_rank=16, index_n_heads=2,
                            index_head_dim=8, index_topk=4, sliding_window=8, num_hidden_layers=2, vocab_size=50,
                            o_groups=2, o_lora_rank=8,
                            compress_rates={"compressed_sparse_attention": rate_csa,
                                            "heavily_compressed_attention": rate_hca})


def _hf_compressor(overlap: bool, seed: int):
    cfg = _hf_config()
    cls = M.DeepseekV4CSACompressor if overlap else M.DeepseekV4HCACompressor
    mod = cls(cfg).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else noise / p.shape[-1] ** 0.5 if p.dim() == 2 else noise)
    return cfg, mod


def _finish_like_hf(mod, entries, first_entry):
    """HF's compressor applies its RMSNorm and RoPE (at each entry's first token) after the pooling."""
    B, T, _ = entries.shape
    x = mod.kv_norm(entries)
    positions = ((torch.arange(T) + first_entry) * mod.compress_rate).expand(B, T)
    cos, sin = mod.rotary_emb(x, position_ids=positions, layer_type=mod.rope_layer_type)
    return M.apply_rotary_pos_emb(x.unsqueeze(1), cos, sin)  # (B, 1, T, D)


@pytest.mark.parametrize("overlap", [False, True], ids=["HCA", "CSA"])
@pytest.mark.parametrize("N", [3, 37, 64], ids=lambda n: f"N{n}")
def test_equals_hf_compressor_in_one_call(overlap, N):
    cfg, mod = _hf_compressor(overlap, seed=N)
    gen = torch.Generator().manual_seed(N + 1)
    h = torch.randn(2, N, cfg.hidden_size, dtype=torch.float64, generator=gen)
    q_res = torch.randn(2, N, cfg.q_lora_rank, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        want, _ = mod(h, q_res, torch.arange(N).expand(2, N), None, 0)
        got = compress_kv(mod.kv_proj(h), mod.gate_proj(h), mod.position_bias, rate=mod.compress_rate,
                          overlap=overlap)
        got_full = _finish_like_hf(mod, got.entries, 0)
    assert got.entries.shape == (2, N // mod.compress_rate, cfg.head_dim)
    assert got.carry.kv.shape[1] == N % mod.compress_rate
    err = (got_full - want).abs().max().item() if want.numel() else 0.0
    assert got_full.shape == want.shape and err < HF_TOL, f"entries off HF's by {err:.3g}"


@pytest.mark.parametrize("overlap", [False, True], ids=["HCA", "CSA"])
def test_pieces_with_carry_equal_hf_cache_and_the_whole(overlap):
    cfg, mod = _hf_compressor(overlap, seed=3)
    cache_cls = M.DeepseekV4CSACache if overlap else M.DeepseekV4HCACache
    cache = types.SimpleNamespace(layers=[cache_cls(cfg)])
    gen = torch.Generator().manual_seed(4)
    cuts = [0, 5, 6, 7, 19, 20, 41, 50]  # pieces of 5, 1, 1, 12, 1, 21, 9 tokens (decode steps among them)
    h = torch.randn(2, cuts[-1], cfg.hidden_size, dtype=torch.float64, generator=gen)
    q_res = torch.randn(2, cuts[-1], cfg.q_lora_rank, dtype=torch.float64, generator=gen)
    carry, pieces = None, []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            want, _ = mod(h[:, a:b], q_res[:, a:b], torch.arange(a, b).expand(2, b - a), cache, 0)
            out = compress_kv(mod.kv_proj(h[:, a:b]), mod.gate_proj(h[:, a:b]), mod.position_bias,
                              rate=mod.compress_rate, overlap=overlap, carry=carry)
            carry = out.carry
            pieces.append(out.entries)
            got = _finish_like_hf(mod, torch.cat(pieces, 1), 0)
            assert got.shape == want.shape
            if want.numel():
                err = (got - want).abs().max().item()
                assert err < HF_TOL, f"after tokens {a}..{b}: off HF's cached compressor by {err:.3g}"
        whole = compress_kv(mod.kv_proj(h), mod.gate_proj(h), mod.position_bias, rate=mod.compress_rate,
                            overlap=overlap).entries
    assert (torch.cat(pieces, 1) - whole).abs().max().item() < 1e-13


@pytest.mark.parametrize("overlap", [False, True], ids=["HCA", "CSA"])
def test_gradients_are_exact(overlap):
    gen = torch.Generator().manual_seed(7)
    C = 6 if overlap else 3
    kv, gate = (torch.randn(1, 11, C, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    bias = torch.randn(3, C, dtype=torch.float64, generator=gen).requires_grad_()
    prev = (torch.randn(1, 3, C // 2, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    carry = CompressCarry(kv[:, :0], gate[:, :0], *prev) if overlap else None

    def f(kv, gate, bias, *prev):
        c = CompressCarry(kv[:, :0], gate[:, :0], *prev) if overlap else None
        return compress_kv(kv, gate, bias, rate=3, overlap=overlap, carry=c).entries

    args = (kv, gate, bias) + ((carry.prev_kv, carry.prev_gate) if overlap else ())
    assert torch.autograd.gradcheck(f, args)


def test_first_window_of_csa_pools_only_its_own_tokens():
    """Without a carry, entry 0's series-A slots weigh 0: it is HCA pooling of window 0's series B."""
    gen = torch.Generator().manual_seed(8)
    kv, gate = torch.randn(2, 1, 8, 6, dtype=torch.float64, generator=gen).unbind(0)
    bias = torch.randn(4, 6, dtype=torch.float64, generator=gen)
    csa = compress_kv(kv, gate, bias, rate=4, overlap=True).entries
    hca = compress_kv(kv[..., 3:], gate[..., 3:], bias[:, 3:], rate=4).entries
    assert torch.allclose(csa[:, 0], hca[:, 0], atol=1e-14)
    assert not torch.allclose(csa[:, 1], hca[:, 1]), "entry 1 must read window 0's series A"


def test_low_precision_pools_in_float32():
    gen = torch.Generator().manual_seed(9)
    kv, gate = torch.randn(2, 2, 64, 8, dtype=torch.float64, generator=gen).unbind(0)
    bias = torch.randn(16, 8, dtype=torch.float64, generator=gen)
    ref = compress_kv(kv, gate, bias, rate=16).entries
    out = compress_kv(kv.bfloat16(), gate.bfloat16(), bias.float(), rate=16).entries
    assert out.dtype == torch.bfloat16
    eager = (torch.softmax(gate.bfloat16().view(2, 4, 16, 8) + bias.bfloat16(), 2) * kv.bfloat16().view(2, 4, 16, 8)
             ).sum(2)  # the same pooling entirely in bfloat16
    budget = 2 * (eager.double() - ref).abs().max().item() + 1e-3
    assert (out.double() - ref).abs().max().item() <= budget


@pytest.mark.parametrize("bad, match", [
    (dict(rate=0), "rate must be an int >= 1"),
    (dict(rate=2.0), "rate must be an int >= 1"),
    (dict(overlap=1), "overlap must be a bool"),
    (dict(kv=torch.zeros(1, 8, 5), gate=torch.zeros(1, 8, 5), position_bias=torch.zeros(4, 5), overlap=True),
     "C = 2D"),
    (dict(gate=torch.zeros(1, 8, 3)), "gate has shape"),
    (dict(kv=torch.zeros(8, 4)), r"kv must be a float \(B, N, C\)"),
    (dict(kv=torch.zeros(1, 8, 4, dtype=torch.int64)), "kv must be a float"),
    (dict(position_bias=torch.zeros(3, 4)), r"position_bias must be \(rate, C\)"),
    (dict(carry=(torch.zeros(1, 0, 4), torch.zeros(1, 0, 4))), "carry must be the CompressCarry"),
    (dict(carry=CompressCarry(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))), "P < rate"),
    (dict(carry=CompressCarry(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 4, 2),
                              torch.zeros(1, 4, 2))), "only overlap=True reads"),
    (dict(carry=CompressCarry(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 4, 2), None)),
     "both be set"),
], ids=["rate0", "rate-float", "overlap-int", "odd-C", "gate-shape", "kv-2d", "kv-int", "bias-shape", "carry-tuple",
        "carry-full-window", "carry-prev-without-overlap", "carry-half-prev"])
def test_bad_inputs_are_refused(bad, match):
    args = dict(kv=torch.zeros(1, 8, 4), gate=torch.zeros(1, 8, 4), position_bias=torch.zeros(4, 4), rate=4,
                overlap=False, carry=None)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        compress_kv(args.pop("kv"), args.pop("gate"), args.pop("position_bias"), **args)
