"""The mixture-of-experts layer: the one-token path against the grouped path."""

from __future__ import annotations

import math

import torch

from qkv.testing import assert_within_budget


def test_experts_single_token_path_equals_the_grouped_one():
    """The one-token path (a one-sequence decode step) against the grouped path that batches tokens per
    expert, run in float64 on all tokens at once (the reference), with the grouped float32 output as the
    baseline; the float64 grouped path itself equals a plain per-token loop over the chosen experts."""
    import copy

    import torch.nn.functional as F

    from qkv.nn.moe import Experts

    torch.manual_seed(0)
    experts = Experts(6, 16, 8, "silu")
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))  # unit scale: outputs O(1)
    ref = copy.deepcopy(experts).double()
    x = torch.randn(3, 16)
    idx = torch.tensor([[4, 1], [0, 4], [5, 2]])
    w = torch.rand(3, 2)

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:  # expert e's gated MLP in float64
        gate, up = F.linear(v, ref.gate_up_proj[e]).chunk(2)
        return F.linear(F.silu(gate) * up, ref.down_proj[e])

    with torch.no_grad():
        grouped = experts(x, idx, w)
        want = ref(x.double(), idx, w.double())
        loop = torch.stack([sum(w[t, j].double() * expert(e, x[t].double()) for j, e in enumerate(idx[t].tolist()))
                            for t in range(3)])
        torch.testing.assert_close(want, loop, rtol=1e-12, atol=1e-12)
        assert want.abs().max() > 0.1, "outputs must be O(1) for the budget to mean anything"
        for t in range(3):
            one = experts(x[t:t + 1], idx[t:t + 1], w[t:t + 1])[0]
            assert_within_budget(one, want[t], grouped[t], what=f"token {t}")
