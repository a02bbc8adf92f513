"""Encoder, decoder and encoder-decoder train on tiny tasks on CPU, and every backend gives the same loss
curve within the error budget (seeded init, same data; float64 reference run as the truth).

Tasks: reverse a sequence (encoder tagger, encoder-decoder) and copy a prefix after a separator (decoder LM).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.nn import DecoderConfig, DecoderLM, EncoderDecoder, TransformerConfig, TransformerEncoder
from qkv.testing import assert_within_budget

V, SEP = 10, 10  # symbols 0..9, separator / BOS 10


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: extra intra-op threads only add contention (badly so on a shared 2-core box).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(position: str, backend: str, **kw) -> TransformerConfig:
    return TransformerConfig(d_model=32, n_heads=4, n_layers=2, position=position, max_position_embeddings=16,
                             vocab_size=V + 1, backend=backend, relative_attention_num_buckets=16,
                             relative_attention_max_distance=16,
                             initializer_range=0.1 if position == "learned" else 0.02, **kw)


class _Tagger(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, cfg.d_model)
        self.encoder = TransformerEncoder(cfg)
        self.head = nn.Linear(cfg.d_model, V)

    def forward(self, x, lengths=None):
        return self.head(self.encoder(self.embed(x), lengths=lengths))


def _step_encoder(model, g, *, padded):
    x = torch.randint(0, V, (32, 8), generator=g)
    if not padded:
        return model(x), x.flip(1), None
    lengths = torch.randint(4, 9, (32,), generator=g)
    lengths[0] = 8
    valid = torch.arange(8).view(1, -1) < lengths.view(-1, 1)
    target = torch.stack([torch.cat((r[:n].flip(0), r[n:])) for r, n in zip(x, lengths.tolist())])
    return model(x, lengths), target, valid


def _step_decoder(model, g, *, padded):
    a = torch.randint(0, V, (32, 6), generator=g)
    seq = torch.cat((a, torch.full((32, 1), SEP), a), dim=1)
    return model(seq[:, :-1]).logits[:, 6:], seq[:, 7:], None


def _decoder(cfg: TransformerConfig) -> DecoderLM:
    """The decoder-only LM of the same shape (RoPE, LayerNorm, GELU MLP, biases, tied head)."""
    dc = DecoderConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                       num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.d_ff,
                       hidden_act=cfg.activation, gated_mlp=False, norm="layer", qkv_bias=True, o_bias=True,
                       mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=cfg.max_position_embeddings,
                       backend=cfg.backend, decode_backend=None)
    model = DecoderLM(dc)
    for m in model.modules():  # the stacks' init: normal(0.02) weights, zero biases
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=cfg.initializer_range)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return model


def _step_seq2seq(model, g, *, padded):
    src = torch.randint(0, V, (32, 6), generator=g)
    tgt = torch.cat((torch.full((32, 1), SEP), src.flip(1)), dim=1)
    lengths = None
    if padded:  # pad every source with two junk tokens the model must not see
        src = torch.cat((src, torch.randint(0, V, (32, 2), generator=g)), dim=1)
        lengths = torch.full((32,), 6)
    return model(src, tgt[:, :-1], src_lengths=lengths), tgt[:, 1:], None


TASKS = {
    "encoder": (lambda cfg: _Tagger(cfg), _step_encoder),
    "decoder": (_decoder, _step_decoder),
    "encoder-decoder": (lambda cfg: EncoderDecoder(cfg), _step_seq2seq),
}


def train(task: str, *, position: str, steps: int, backend: str = "auto", dtype=torch.float32,
          padded: bool = False, seed: int = 0, **cfg_kw) -> tuple[list[float], float]:
    """Adam on fresh batches; returns the loss per step and the final batch's token accuracy."""
    build, step = TASKS[task]
    torch.manual_seed(seed)
    model = build(_config(position, backend, **cfg_kw)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        logits, target, valid = step(model, g, padded=padded)
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        if valid is not None:
            logits, target = logits[valid.reshape(-1)], target[valid.reshape(-1)]
        loss = F.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    acc = float((logits.argmax(-1) == target).float().mean())
    return losses, acc


@pytest.mark.parametrize("task,position", [("encoder", "learned"), ("decoder", "rope"),
                                           ("encoder-decoder", "learned")])
def test_learns_tiny_task(task, position):
    """Three seeds: Adam at lr 1e-2 on 32-row batches sometimes oscillates for a while (a float32 run's
    trajectory moves with the kernels' rounding), so the median run must learn, not every one."""
    runs = sorted((train(task, position=position, steps=150, seed=seed) for seed in range(3)), key=lambda r: r[1])
    losses, acc = runs[1]  # the median accuracy
    assert acc >= 0.9, f"{task}: token accuracy {acc:.2f} after 150 steps (chance 0.1); losses {losses[::25]}"
    assert losses[-1] < 0.25 * losses[0]


def _run(backend: str, **kw):
    """The loss curve on ``backend``; a backend that declines one of the model's attention calls fails the test
    (every backend named here runs ALiBi, GQA and T5 buckets: a decline would be a regression, not a skip)."""
    return train(backend=backend, **kw)[0]


@functools.cache
def _reference_curves(task: str, position: str, extra: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 truth and the float32 eager baseline (reference backend), computed once per model."""
    kw = dict(task=task, position=position, steps=10, padded=True, **dict(extra))
    truth = torch.tensor(train(backend="reference", dtype=torch.float64, **kw)[0], dtype=torch.float64)
    return truth, torch.tensor(train(backend="reference", **kw)[0])


# The reference backend is the baseline (float32) and the truth (float64), so it is not a candidate here: a
# run compared with itself cannot fail. It is checked against independent code in test_reference.py.
BACKENDS = [b for b in ("sdpa", "tiled") if b in qkv.backends.names()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("task,position,extra", [
    ("encoder", "alibi", {}),                       # ALiBi bias + key padding
    ("decoder", "rope", {"n_kv_heads": 2}),          # RoPE, GQA, causal
    ("encoder-decoder", "t5", {}),                  # T5 buckets, cross attention with source padding
], ids=["encoder-alibi-padding", "decoder-rope-gqa", "seq2seq-t5-padding"])
def test_backends_give_the_same_loss_curve(task, position, extra, backend):
    assert "sdpa" in BACKENDS and "reference" in qkv.backends.names()
    truth, baseline = _reference_curves(task, position, tuple(sorted(extra.items())))
    got = torch.tensor(_run(backend, task=task, position=position, steps=10, padded=True, **extra))
    assert torch.isfinite(got).all()
    assert_within_budget(got, truth, baseline, what=f"{task} loss curve on {backend}")
