"""Cases shared by the distributed tests: global inputs built identically in the worker processes and in the
single-process reference (seeded), and the masks and modifiers each case uses."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

import qkv


@dataclass(frozen=True)
class Case:
    name: str
    B: int = 1
    Hq: int = 4
    Hkv: int = 2
    nq: int = 4  # per rank
    nk: int = 4
    Dqk: int = 8
    Dv: int = 6
    docs: bool = False  # zigzag layouts balance per document
    dtype: torch.dtype = torch.float32

    def id(self, scheme: str, world: int) -> str:
        return (f"{scheme}-W{world}-{self.name}-B{self.B}-H{self.Hq}x{self.Hkv}-n{self.nq}x{self.nk}"
                f"-D{self.Dqk}x{self.Dv}-{str(self.dtype).replace('torch.', '')}")


def documents(n: int) -> torch.Tensor:
    """Uneven document lengths: 3, 9, 1, then the rest."""
    lengths = [3, 9, 1, n - 13]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def build(case: Case, world: int):
    """Global (q, k, v, dout, dlse), the mask, the modifiers (with a learnable bias when the case has one)."""
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    NQ, NK = case.nq * world, case.nk * world
    q = torch.randn(case.B, case.Hq, NQ, case.Dqk, generator=g, dtype=torch.float64)
    k = torch.randn(case.B, case.Hkv, NK, case.Dqk, generator=g, dtype=torch.float64)
    v = torch.randn(case.B, case.Hkv, NK, case.Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(case.B, case.Hq, NQ, case.Dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(case.B, case.Hq, NQ, generator=g, dtype=torch.float64)
    bias = torch.randn(1, case.Hq, NQ, NK, generator=g, dtype=torch.float64) * 0.5
    m, mods = qkv.masks, qkv.mods
    slopes = qkv.pos.alibi_slopes(case.Hq).to(torch.float32)
    if case.name in ("causal-bias", "causal-bias-bf16"):
        mask, mod = m.causal(), "bias"
    elif case.name == "window-alibi-softcap":
        mask, mod = m.sliding_window(5), [mods.alibi(slopes), mods.softcap(3.0)]
    elif case.name == "documents":
        mask, mod = m.document(documents(NQ)) & m.causal(), None
    elif case.name == "padding-prefix":
        mask, mod = m.prefix_lm(torch.tensor([5, NQ // 2])) & m.padding(torch.tensor([NK - 3, NK])), None
    elif case.name in ("causal-br-cross", "causal-br-empty-rows"):
        mask, mod = m.causal(), None
    elif case.name == "causal-tl-cross":
        mask, mod = m.causal(align="top_left"), None
    elif case.name == "full":
        mask, mod = None, None
    else:
        raise KeyError(case.name)
    return q, k, v, dout, dlse, bias, mask, mod


def score_mod(mod, bias_tensor):
    return qkv.mods.bias(bias_tensor) if mod == "bias" else mod


CASES_W2 = [
    Case("causal-bias"),
    Case("causal-bias-bf16", nq=8, nk=8, Dv=8, dtype=torch.bfloat16),
    Case("window-alibi-softcap", nq=6, nk=6),
    Case("documents", nq=12, nk=12, Hkv=1, docs=True),
    Case("padding-prefix", B=2, nq=6, nk=6, Hkv=4),
    Case("causal-br-cross", nq=2, nk=4),
    Case("causal-tl-cross", nq=4, nk=2),
    Case("causal-br-empty-rows", nq=4, nk=2),  # the first queries see no key: zeros, lse -inf, zero gradients
]
CASES_W4 = [Case("causal-bias"), Case("documents", nq=8, nk=8, docs=True), Case("causal-br-cross", nq=2, nk=4)]
SCHEMES_W2 = ["ring", "zigzag", "stripe", "allgather", "ulysses"]
SCHEMES_W4 = ["ring", "zigzag", "stripe", "allgather", "ulysses", "usp"]
