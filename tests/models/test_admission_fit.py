"""Engine admission at the edge: a request reserves exactly the blocks its prompt and every token fed back fill, so
a pool that fits two reservations exactly runs both at once, and a pool one block short runs them one after the
other; a reservation one token short would admit both into a pool they overflow (#46: the missing test)."""

from __future__ import annotations

import torch

from _toy_lm import single_thread  # noqa: F401 (autouse fixture)
from qkv.models import Engine, generate
from qkv.nn import DecoderConfig, DecoderLM

T = 4
PROMPT, BUDGET = [3, 1, 4, 1, 5, 9], 4  # 6 + 4 - 1 = 9 tokens stored: 3 blocks of 4; one token short would be 2


def _lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=31, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64)).double().eval()


def _serve(num_blocks: int):
    model = _lm()
    engine = Engine(model, num_blocks=num_blocks, block_size=T, max_batch=2, optimize=False)
    ids = [engine.add(PROMPT, BUDGET), engine.add(PROMPT[::-1], BUDGET)]
    engine.step()
    together = len(engine.running)
    results = engine.run()
    alone = [generate(model, torch.tensor([p]), max_new_tokens=BUDGET).new_tokens[0].tolist()
             for p in (PROMPT, PROMPT[::-1])]
    assert [results[i].tokens for i in ids] == alone
    return together


def test_a_pool_that_fits_both_reservations_exactly_runs_them_together():
    assert _serve(6) == 2


def test_a_pool_one_block_short_runs_them_one_after_the_other():
    assert _serve(5) == 1
