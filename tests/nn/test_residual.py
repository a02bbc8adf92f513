"""The residual-stream protocol of the decoder (qkv.nn.residual): the plain residual is the decoder's old ``x + y``
(bit for bit), a wider residual plugged in through the protocol carries its streams through every layer, cached
decode and ``logits_to_keep``, and a residual that writes back something else changes the logits."""

from __future__ import annotations

import pytest
import torch

from qkv.cache import KVCache
from qkv.config import get_config
from qkv.nn import DecoderLM
from qkv.nn.residual import PLAIN_RESIDUAL, RESIDUAL_SITES, PlainResidual, Residual, residual_for


class _Copies:
    """``n`` identical streams (B, N, n, d): the branch reads their mean and adds its output to each; the model
    collapses them by their mean. Equal to the plain residual in exact arithmetic, and in floating point too (the
    mean of equal values is that value)."""

    def __init__(self, n: int, scale: float = 1.0) -> None:
        self.n, self.scale = n, scale

    def widen(self, h):
        return h.unsqueeze(2).expand(-1, -1, self.n, -1).contiguous()

    def enter(self, streams):
        return streams.mean(2), "ctx"

    def leave(self, streams, y, ctx):
        assert ctx == "ctx"
        return streams[:, streams.shape[1] - y.shape[1]:] + self.scale * y.unsqueeze(2)

    def collapse(self, streams):
        return streams.mean(2)


def _lm(name: str = "tiny-llama") -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(get_config(name)).double().eval()


def _plug(lm: DecoderLM, residual) -> DecoderLM:
    lm.residual = residual
    for layer in lm.layers:
        layer.attn_residual = layer.ffn_residual = residual
    return lm


def test_plain_is_the_default_everywhere_and_adds_no_weights():
    lm = _lm()
    assert lm.residual is PLAIN_RESIDUAL
    assert all(layer.attn_residual is PLAIN_RESIDUAL and layer.ffn_residual is PLAIN_RESIDUAL for layer in lm.layers)
    assert not any("residual" in k for k in lm.state_dict())
    assert isinstance(PLAIN_RESIDUAL, Residual) and isinstance(_Copies(2), Residual)


def test_plain_residual_math():
    x, y = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    r = PlainResidual()
    assert r.widen(x) is x and r.collapse(x) is x
    a, ctx = r.enter(x)
    assert a is x and ctx is None
    torch.testing.assert_close(r.leave(x, y, ctx), x + y, rtol=0, atol=0)
    torch.testing.assert_close(r.leave(x, y[:, -2:], ctx), x[:, -2:] + y[:, -2:], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma"])
def test_wider_streams_through_the_protocol_equal_plain(name):
    """Two identical streams give the plain model's logits bit for bit: prefill, logits_to_keep and cached decode."""
    ids = torch.randint(0, 256, (2, 9))
    plain = _lm(name)
    wide = _plug(_lm(name), _Copies(2))
    torch.testing.assert_close(wide(ids).logits, plain(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(wide(ids, logits_to_keep=3).logits, plain(ids, logits_to_keep=3).logits, rtol=0, atol=0)
    cache_p, cache_w = KVCache(plain.cache_specs()), KVCache(wide.cache_specs())
    plain(ids[:, :6], cache=cache_p)
    wide(ids[:, :6], cache=cache_w)
    step_p = plain(ids[:, 6:], cache=cache_p).logits
    step_w = wide(ids[:, 6:], cache=cache_w).logits
    torch.testing.assert_close(step_w, step_p, rtol=0, atol=0)
    torch.testing.assert_close(step_w, plain(ids).logits[:, 6:], rtol=1e-12, atol=1e-12)


def test_a_residual_that_writes_back_something_else_changes_the_logits():
    ids = torch.randint(0, 256, (1, 7))
    plain = _lm()
    poisoned = _plug(_lm(), _Copies(2, scale=1.5))
    assert (poisoned(ids).logits - plain(ids).logits).abs().max() > 1e-3


def test_residual_for_refuses_bad_sites_and_layers():
    c = get_config("tiny-llama", num_hidden_layers=2)
    assert {residual_for(c, 1, s) for s in ("attn", "ffn")} | {residual_for(c, None, "model")} == {PLAIN_RESIDUAL}
    assert RESIDUAL_SITES == ("attn", "ffn", "model")
    with pytest.raises(ValueError, match="site must be one of"):
        residual_for(c, 0, "mlp")
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\)"):
        residual_for(c, 2, "attn")
    with pytest.raises(ValueError, match=r"layer_idx must be an int"):
        residual_for(c, None, "ffn")
    with pytest.raises(ValueError, match="pass layer_idx=None"):
        residual_for(c, 0, "model")
