"""The HF parity suite every decoder family's test file parametrizes (as HF's ``ModelTesterMixin``): a family file
subclasses :class:`LogitParity` (and :class:`HFRouteParity` where HF's ``attn_implementation="qkv"`` reaches its
attention), sets ``CASES`` and gives ``models(case)`` and ``prompt(case, padded=)``; each test then runs once per
case.

The tests compare qkv float32 against HF eager float64 (the reference) with HF eager float32 as the error budget's
baseline (``tests/_hf.py``):

- prefill logits, and a cached decode whose last step is one token (``DECODE_TAIL``: the steps after the prefill);
- left-padded prefill logits, the reference each row alone without its padding;
- cached greedy generation of a left-padded batch emits HF ``generate``'s tokens;
- (:class:`HFRouteParity`) HF's own model with ``attn_implementation="qkv"`` gives eager's logits.

Families add their own checks through the hooks (``check_prefill``, ``check_generation``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import within_budget
from qkv.cache import KVCache
from qkv.models.generate import generate, prompt_positions


def engine_matches_generate(model, prompts: list[list[int]], max_new_tokens: int, **engine_kw) -> None:
    """The continuous-batching Engine (paged pools, row slots) gives each request the greedy tokens of ``generate``
    by full recomputation on that request alone."""
    from qkv.models import Engine

    engine = Engine(model, **{"num_blocks": 64, "block_size": 4, "max_batch": 2, **engine_kw})
    rids = [engine.add(p, max_new_tokens) for p in prompts]
    results = engine.run()
    for rid, p in zip(rids, prompts):
        want = generate(model, torch.tensor([p]), max_new_tokens=max_new_tokens, use_cache=False).new_tokens[0]
        assert results[rid].tokens == want.tolist(), f"prompt {p}: engine {results[rid].tokens}, {want.tolist()}"


class LogitParity:
    """Prefill, cached decode, left padding and greedy generation against HF (module notes)."""

    CASES: dict = {}
    N_NEW = 8
    DECODE_TAIL: tuple[int, ...] = (1,)  # new tokens per cached step after the prefill, the last one checked; ()
    # checks the prefill only
    HF_PADDED_POSITIONS = True  # HF's padded baseline is given qkv's positions (the padding's clamped to 0)

    def pytest_generate_tests(self, metafunc):
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", list(self.CASES))

    def models(self, case: str):
        """(hf float32, hf float64, qkv float32) of ``case``, built once per session."""
        raise NotImplementedError

    def prompt(self, case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (2, N_PROMPT), 0/1 mask) of ``case``, the second row left-padded when ``padded``."""
        raise NotImplementedError

    def generation_cache(self, case: str, model):
        """The cache greedy generation runs on (None: ``generate``'s default)."""
        return None

    def check_prefill(self, case: str, model, ids: torch.Tensor, truth: torch.Tensor) -> None:
        """More checks of a family on the unpadded prompt ``ids`` and the reference logits ``truth``."""

    def check_generation(self, case: str, model, ids: torch.Tensor, mask: torch.Tensor, out, expected) -> None:
        """More checks of a family on the generation of the padded prompt ``ids`` (HF's tokens ``expected``)."""

    def check_padded(self, case: str, budget, truth: torch.Tensor) -> None:
        """More checks of a family on the left-padded prefill's budget (``within_budget``'s result)."""

    def generates_hf_tokens(self, case: str, ids: torch.Tensor, mask: torch.Tensor | None):
        """Greedy generation of ``ids`` (``mask``: its padding, or None) on the case's cache emits HF ``generate``'s
        tokens; the assertion names the first differing step and the top-2 logit margins there. Returns
        ``(qkv's GenerateOutput, HF's new tokens)``."""
        hf, _, model = self.models(case)
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                                   max_new_tokens=self.N_NEW, do_sample=False)[:, ids.shape[1]:]
        out = generate(model, ids, max_new_tokens=self.N_NEW, attention_mask=mask,
                       cache=self.generation_cache(case, model), return_logits=True)
        if not torch.equal(out.new_tokens, expected):
            first = (out.new_tokens != expected).any(0).nonzero()[0].item()
            top2 = out.logits[:, first].topk(2).values
            raise AssertionError(f"{case}: greedy tokens differ from step {first} on\nqkv {out.new_tokens.tolist()}\n"
                                 f"hf  {expected.tolist()}\n(top-2 logit margins there "
                                 f"{(top2[:, 0] - top2[:, 1]).tolist()})")
        return out, expected

    def test_prefill_and_decode_step_within_budget(self, case):
        hf, ref, model = self.models(case)
        ids, _ = self.prompt(case, padded=False)
        with torch.no_grad():
            truth, base = ref(ids).logits, hf(ids).logits
            within_budget(model(ids).logits, truth, base, what=f"{case} prefill logits")
            if self.DECODE_TAIL:
                cache = KVCache(model.cache_specs())
                start = ids.shape[1] - sum(self.DECODE_TAIL)
                model(ids[:, :start], cache=cache)
                for n in self.DECODE_TAIL:  # a multi-token step first where the tail says so
                    step = model(ids[:, start:start + n], cache=cache).logits[:, -1]
                    start += n
                within_budget(step, truth[:, -1], base[:, -1], what=f"{case} cached decode step")
        self.check_prefill(case, model, ids, truth)
        assert truth.std() > 0.5, "logits must be O(1) for the budget to mean anything"

    def test_left_padded_prefill_within_budget(self, case):
        """The reference is each row alone without its padding; the baseline HF float32 on the padded batch."""
        hf, ref, model = self.models(case)
        ids, mask = self.prompt(case, padded=True)
        pos = prompt_positions(mask)
        real = mask.bool()
        with torch.no_grad():
            ours = model(ids, positions=pos).logits
            extra = {"position_ids": pos.clamp_min(0)} if self.HF_PADDED_POSITIONS else {}
            base = hf(ids, attention_mask=mask, **extra).logits
            truth = torch.cat([ref(ids[b, real[b]][None]).logits[0] for b in range(ids.shape[0])])
            budget = within_budget(ours[real], truth, base[real], what=f"{case} left-padded prefill logits")
        self.check_padded(case, budget, truth)

    def test_cached_greedy_generation_matches_hf(self, case):
        ids, mask = self.prompt(case, padded=True)
        out, expected = self.generates_hf_tokens(case, ids, mask)
        self.check_generation(case, self.models(case)[2], ids, mask, out, expected)


class HFRouteParity:
    """HF's own model with ``attn_implementation="qkv"`` against HF eager (module notes); with :class:`LogitParity`."""

    def test_hf_route_gives_eager_logits(self, case):
        """Within budget of eager float64, eager float32 the baseline (left-padded batch)."""
        pytest.importorskip("transformers")
        import qkv.integrations.transformers as qhf

        hf, ref, _ = self.models(case)
        cand = copy.deepcopy(hf)
        qhf.use(cand)
        ids, mask = self.prompt(case, padded=True)
        real = mask.bool()
        with torch.no_grad():
            ours = cand(ids, attention_mask=mask).logits
            base = hf(ids, attention_mask=mask).logits
            truth = torch.cat([ref(ids[b, real[b]][None]).logits[0] for b in range(ids.shape[0])])
        within_budget(ours[real], truth, base[real], what=f"{case} attn_implementation='qkv' logits")
