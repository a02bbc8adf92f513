"""``DecoderLM(..., logits_to_keep=)`` refuses what is not an int >= 0 naming ``logits_to_keep`` itself: ``True``
(a bool is an int to Python) once reached the inner ``queries_to_keep`` check and was reported under that name
(#46 item 8)."""

from __future__ import annotations

import pytest
import torch

from qkv.nn import DecoderConfig, DecoderLM


@pytest.mark.parametrize("value", [True, False, 1.0, -1, "1", None])
def test_a_bad_logits_to_keep_is_named(value):
    torch.manual_seed(0)
    lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 intermediate_size=64)).eval()
    with pytest.raises(ValueError, match=r"DecoderLM: logits_to_keep must be an int >= 0 .* got " + repr(value)):
        lm(torch.tensor([[1, 2, 3]]), logits_to_keep=value)
    assert lm(torch.tensor([[1, 2, 3]]), logits_to_keep=2).logits.shape == (1, 2, 50)
