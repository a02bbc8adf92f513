"""The conformance battery: probes an attention callable and compares it with qkv's contract.

Every expected value comes from ``qkv.attention(..., backend="reference")`` on float64 copies of the inputs
(the oracle). Where a kernel disagrees, the battery also evaluates the usual alternative conventions (base-2
log-sum-exp, token-major lse, top-left causal, ``h % Hkv`` head mapping, softcap after the mask, sink left
out of the lse) in float64 and names the one the kernel follows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .. import masks as M
from .. import mods
from .._attention import attention
from ..plain import PlainFn, accepted_options, call, restrict
from ..testing import check_batch_invariance
from ._report import Finding

__all__ = ["Case", "run_battery"]

_TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
_LN2 = math.log(2.0)
QKV_LSE = "e (natural log)"
QKV_LAYOUT = "(B, H, N)"


@dataclass
class Case:
    """A reproducing input: shapes, dtype, seed and the plain-form options; ``tensors()`` rebuilds it."""

    B: int = 2
    Hq: int = 2
    Hkv: int = 2
    Nq: int = 7
    Nk: int = 9
    D: int = 16
    dtype: str = "float32"
    seed: int = 0
    options: dict = field(default_factory=dict)

    def tensors(self, device="cpu"):
        """(q, k, v, sinks or None) drawn from ``seed`` (CPU generator, then moved)."""
        g = torch.Generator().manual_seed(self.seed)
        dt = getattr(torch, self.dtype)
        q = torch.randn(self.B, self.Hq, self.Nq, self.D, generator=g)
        k = torch.randn(self.B, self.Hkv, self.Nk, self.D, generator=g)
        v = torch.randn(self.B, self.Hkv, self.Nk, self.D, generator=g)
        sinks = torch.randn(self.Hq, generator=g) if self.options.get("sinks") else None
        move = (lambda t: t.to(device=device, dtype=dt))
        return move(q), move(k), move(v), (None if sinks is None else sinks.to(device=device, dtype=torch.float32))

    def as_dict(self) -> dict:
        return asdict(self)


def _mask(Nq: int, Nk: int, *, causal=False, window=None, align="bottom_right"):
    """A dense qkv mask for causal/window in either alignment (None when neither is asked)."""
    if not causal and window is None:
        return None
    p = torch.arange(Nq).view(-1, 1) + (Nk - Nq if align == "bottom_right" else 0)
    j = torch.arange(Nk).view(1, -1)
    allowed = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        allowed &= j <= p
    if window is not None:
        allowed &= (j >= p - window[0]) & (j <= p + window[1])
    return M.dense(allowed.view(1, 1, Nq, Nk))


def _oracle(case: Case, *, align="bottom_right", window="same", gqa="div", softcap_mode="before_mask",
            sink_in_lse=True):
    """float64 (out, lse) under qkv's contract, or under one named alternative convention."""
    q, k, v, sinks = case.tensors()
    q, k, v = q.double(), k.double(), v.double()
    opts = case.options
    win = opts.get("window") if window == "same" else window
    mask = _mask(case.Nq, case.Nk, causal=bool(opts.get("causal")), window=win, align=align)
    if gqa == "mod":  # query head h reads kv head h % Hkv
        idx = torch.arange(case.Hq) % case.Hkv
        k, v = k[:, idx], v[:, idx]
    scale = opts.get("scale")
    cap = opts.get("softcap")
    if cap is not None and softcap_mode != "before_mask":
        return _eager_alt(q, k, v, mask, scale if scale is not None else case.D ** -0.5, cap, softcap_mode, sinks)
    score_mod = mods.softcap(cap) if cap is not None else None
    out, lse = attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, sinks=sinks, return_lse=True,
                         backend="reference")
    if sinks is not None and not sink_in_lse:
        lse = attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_lse=True,
                        backend="reference").lse
    return out, lse.double()


def _eager_alt(q, k, v, mask, scale, cap, mode, sinks):
    """Softcap conventions other than qkv's, in float64: ``after_mask`` caps the masked -inf to -cap;
    ``before_scale`` caps ``q.k`` and scales afterwards."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    raw = q @ k.transpose(-1, -2)
    allowed = (mask.materialize(q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if mask is not None
               else torch.ones_like(raw, dtype=torch.bool))
    if mode == "before_scale":
        s = (scale * cap * torch.tanh(raw / cap)).masked_fill(~allowed, float("-inf"))
    else:
        s = cap * torch.tanh(scale * raw.masked_fill(~allowed, float("-inf")) / cap)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def _err(seen: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference over entries finite in ``ref``, relative to max(1, |ref|); inf when shapes differ
    or a compared entry of ``seen`` is not finite."""
    if seen.shape != ref.shape:
        return math.inf
    seen = seen.detach().double().cpu()
    fin = torch.isfinite(ref)
    if not bool(fin.any()):
        return 0.0
    d = (seen[fin] - ref[fin]).abs()
    if not bool(torch.isfinite(d).all()):
        return math.inf
    return float(d.max()) / max(1.0, float(ref[fin].abs().max()))


def _close(seen, ref, dtype: torch.dtype) -> bool:
    return _err(seen, ref) <= _TOL[dtype]


def _lse_layouts(lse: torch.Tensor, B: int, H: int, N: int) -> dict[str, torch.Tensor]:
    """Every reading of ``lse`` as (B, H, N) its shape allows, keyed by the layout's name."""
    t = lse.detach()
    while t.dim() > 1 and t.shape[-1] == 1 and t.dim() > 3:
        t = t.squeeze(-1)
    out = {}
    if t.shape == (B, H, N):
        out["(B, H, N)"] = t
    if t.shape == (B, N, H):
        out["(B, N, H)"] = t.transpose(1, 2)
    if t.shape == (H, B * N):
        out["(H, total) varlen"] = t.view(H, B, N).transpose(0, 1)
    if t.shape == (B * N, H):
        out["(total, H) varlen"] = t.view(B, N, H).transpose(1, 2)
    return out


@dataclass
class _Lse:
    layout: str | None = None
    base: str | None = None

    def normalize(self, lse: torch.Tensor, B: int, H: int, N: int) -> torch.Tensor | None:
        """``lse`` read as (B, H, N), natural log, by the layout and base the probe found."""
        if self.layout is None or self.base is None:
            return None
        t = _lse_layouts(lse, B, H, N).get(self.layout)
        if t is None:
            return None
        t = t.double().cpu()
        return t * _LN2 if self.base == "2" else t


class _Battery:
    def __init__(self, fn: PlainFn, device, dtypes, seed: int) -> None:
        self.fn = fn
        self.device = torch.device(device)
        self.dtypes = tuple(dtypes)
        self.dtype = torch.float32 if torch.float32 in self.dtypes else self.dtypes[0]
        self.seed = seed
        self.accepts = accepted_options(fn)
        self.lse = _Lse()
        self.align: str | None = None
        self.findings: list[Finding] = []

    def case(self, **kw) -> Case:
        kw.setdefault("dtype", str(self.dtype).replace("torch.", ""))
        kw.setdefault("seed", self.seed)
        return Case(**kw)

    def run(self, case: Case):
        q, k, v, sinks = case.tensors(self.device)
        opts = dict(case.options)
        if sinks is not None:
            opts["sinks"] = sinks
        return call(self.fn, q, k, v, **opts)

    def add(self, check: str, ok, expected: str, seen: str, case: Case | None, note: str = "") -> None:
        self.findings.append(Finding(check, ok, expected, seen, None if case is None else case.as_dict(), note))

    def unsupported(self, check: str, expected: str, needs: tuple[str, ...]) -> bool:
        missing = [n for n in needs if n not in self.accepts]
        if missing:
            self.add(check, None, expected, f"not supported (takes no {', '.join(missing)})", None)
            return True
        return False

    def guarded(self, check: str, expected: str, body) -> None:
        try:
            body()
        except Exception as e:  # a kernel that raises is a finding, not a crash of the battery
            # refusing a request it cannot honour is allowed by the contract (n/a), except for an empty key set,
            # which the contract defines (zeros, lse -inf)
            ok = False if check in ("empty_keys", "values") else None
            self.add(check, ok, expected, f"raised {type(e).__name__}: {_short(e)}", None)
            if check == "lse_layout":  # the lse cannot be had: later checks run without it
                self.accepts = self.accepts - {"return_lse"}
                self.fn = restrict(self.fn, self.accepts)
                self.add("lse_base", None, QKV_LSE, "unknown (return_lse raised)", None)

    def probe_lse(self) -> None:
        expected_layout, expected_base = QKV_LAYOUT, QKV_LSE
        if self.unsupported("lse_layout", expected_layout, ("return_lse",)):
            self.add("lse_base", None, expected_base, "not supported (takes no return_lse)", None)
            return
        case = self.case(B=2, Hq=3, Hkv=3, Nq=5, Nk=5, options={"return_lse": True})
        _, lse = self.run(case)
        _, ref = _oracle(case)
        layouts = _lse_layouts(torch.as_tensor(lse), 2, 3, 5)
        if not layouts:
            self.add("lse_layout", False, expected_layout, f"shape {tuple(lse.shape)} fits none of (B, H, N), "
                     f"(B, N, H), (H, total), (total, H)", case)
            self.add("lse_base", None, expected_base, "unknown (layout not found)", case)
            return
        for name, t in layouts.items():
            t = t.double().cpu()
            for base, value in (("e", t), ("2", t * _LN2)):
                if _close(value, ref, self.dtype):
                    self.lse = _Lse(name, base)
        if self.lse.layout is None:
            name = next(iter(layouts))
            self.add("lse_layout", None, expected_layout, f"shape {tuple(lse.shape)}, values match neither base",
                     case)
            self.add("lse_base", False, expected_base, f"neither e nor 2 (error {_err(layouts[name], ref):.3g})",
                     case)
            return
        self.add("lse_layout", self.lse.layout == QKV_LAYOUT, expected_layout, self.lse.layout, case)
        self.add("lse_base", self.lse.base == "e", expected_base, QKV_LSE if self.lse.base == "e" else "2", case)

    def values(self) -> None:
        expected = "matches the float64 reference"
        case = self.case(B=2, Hq=2, Hkv=2, Nq=7, Nk=9)
        out, _ = self.run(case)
        ref, _ = _oracle(case)
        e = _err(out, ref)
        self.add("values", e <= _TOL[self.dtype], expected, f"error {e:.3g} (tolerance {_TOL[self.dtype]:g})", case)

    def causal_alignment(self) -> None:
        expected = "bottom-right (row i at key position i + Nk - Nq)"
        if self.unsupported("causal_alignment", expected, ("causal",)):
            return
        seen, bad_case = [], None
        for nq, nk in ((3, 8), (8, 3)):
            case = self.case(B=1, Hq=2, Hkv=2, Nq=nq, Nk=nk, options={"causal": True})
            out, _ = self.run(case)
            br, _ = _oracle(case, align="bottom_right")
            tl, _ = _oracle(case, align="top_left")
            rows = slice(max(0, nq - nk), nq)  # rows with keys under both alignments
            found = ("bottom-right" if _close(out[..., rows, :], br[..., rows, :], self.dtype) else
                     "top-left" if _close(out[..., rows, :], tl[..., rows, :], self.dtype) else "neither")
            if found != "neither":
                self.align = self.align or found.replace("-", "_")
            seen.append(f"Nq{'<' if nq < nk else '>'}Nk: {found}")
            if found != "bottom-right" and bad_case is None:
                bad_case = case
        self.add("causal_alignment", bad_case is None, expected, "; ".join(seen), bad_case or case)

    def masked_rows(self) -> None:
        expected = "zeros, lse -inf"
        if self.unsupported("masked_rows", expected, ("causal",)) and "window" not in self.accepts:
            return
        self.findings = [f for f in self.findings if not (f.check == "masked_rows" and f.ok is None)]
        want_lse = "return_lse" in self.accepts
        options = ({"causal": True} if self.align in (None, "bottom_right") and "causal" in self.accepts
                   else {"window": (0, 0)} if "window" in self.accepts else None)
        if options is None:
            self.add("masked_rows", None, expected, "no option of this kernel leaves a row without keys", None)
            return
        options["return_lse"] = want_lse or None
        case = self.case(B=1, Hq=2, Hkv=2, Nq=8, Nk=3, options={k: v for k, v in options.items() if v})
        out, lse = self.run(case)
        align = self.align or "bottom_right"
        ref, _ = _oracle(case, align=align)
        mask = _mask(8, 3, causal=bool(options.get("causal")), window=options.get("window"), align=align)
        empty = ~mask.materialize(1, 1, 8, 3)[0, 0].any(-1)
        if not bool(empty.any()):
            self.add("masked_rows", None, expected, "this kernel's alignment leaves no row without keys", case)
            return
        rows = out.detach().double().cpu()[..., empty, :]
        seen = ("NaN" if bool(torch.isnan(rows).any()) else "zeros" if bool((rows == 0).all())
                else f"garbage (max |out| {float(rows.abs().max()):.3g})")
        ok = seen == "zeros"
        if want_lse and lse is not None:
            t = self.lse.normalize(lse, 1, 2, 8)
            if t is not None:
                r = t[..., empty]
                lse_seen = ("-inf" if bool(torch.isneginf(r).all()) else "NaN" if bool(torch.isnan(r).any())
                            else f"{float(r.flatten()[0]):.3g}")
                seen += f", lse {lse_seen}"
                ok = ok and lse_seen == "-inf"
        self.add("masked_rows", ok, expected, seen, case)

    def window(self) -> None:
        expected = "bottom-right, keys p-2 .. p+1 (window=(2, 1), both ends inclusive)"
        if self.unsupported("window", expected, ("window",)):
            return
        case = self.case(B=1, Hq=2, Hkv=2, Nq=6, Nk=10, options={"window": (2, 1)})
        out, _ = self.run(case)
        for align in ("bottom_right", "top_left"):
            for dl in (0, -1, 1):
                for dr in (0, -1, 1):
                    win = (2 + dl, 1 + dr)
                    ref, _ = _oracle(case, align=align, window=win)
                    if _close(out, ref, self.dtype):
                        seen = f"{align.replace('_', '-')}, keys p-{win[0]} .. p+{win[1]}"
                        self.add("window", (align, dl, dr) == ("bottom_right", 0, 0), expected, seen, case)
                        return
        self.add("window", False, expected, "none of bottom-right/top-left with bounds off by one", case)

    def gqa_mapping(self) -> None:
        expected = "query head h reads kv head h // (Hq // Hkv)"
        case = self.case(B=1, Hq=4, Hkv=2, Nq=5, Nk=6)
        out, _ = self.run(case)
        div, _ = _oracle(case)
        mod, _ = _oracle(case, gqa="mod")
        seen = ("h // group" if _close(out, div, self.dtype) else "h % Hkv" if _close(out, mod, self.dtype)
                else "neither h // group nor h % Hkv")
        self.add("gqa_mapping", seen == "h // group", expected, seen, case)

    def softcap_order(self) -> None:
        expected = "cap * tanh(scale * q.k / cap), then the mask"
        if self.unsupported("softcap_order", expected, ("softcap",)):
            return
        options = {"softcap": 2.0}
        if "causal" in self.accepts:
            options["causal"] = True
        case = self.case(B=1, Hq=2, Hkv=2, Nq=6, Nk=6, D=16, options=options)
        q, k, v, _ = case.tensors()
        case_q = case  # inputs scaled up so that the cap bites
        out, _ = call(self.fn, *(t.to(self.device) * 3 for t in (q, k, v)), **options)
        found = "neither"
        for mode, name in (("before_mask", "capped, then masked"), ("after_mask", "masked, then capped"),
                           ("before_scale", "capped before the scale")):
            ref, _ = _oracle_scaled(case_q, 3.0, softcap_mode=mode)
            if _close(out, ref, self.dtype):
                found = name
                break
        self.add("softcap_order", found == "capped, then masked", expected, found, case,
                 note="inputs are Case.tensors() times 3")

    def sinks_in_lse(self) -> None:
        expected = "out and lse include the sink (lse = log(sum exp(scores) + exp(sink)))"
        if self.unsupported("sinks_in_lse", expected, ("sinks",)):
            return
        ret = "return_lse" in self.accepts
        case = self.case(B=1, Hq=2, Hkv=2, Nq=5, Nk=5, options={"sinks": True, "return_lse": ret or None})
        case.options = {k: v for k, v in case.options.items() if v}
        out, lse = self.run(case)
        ref, ref_lse = _oracle(case)
        out_ok = _close(out, ref, self.dtype)
        seen = "out includes the sink" if out_ok else "out ignores or misuses the sink"
        ok = out_ok
        if ret and lse is not None:
            t = self.lse.normalize(lse, 1, 2, 5)
            if t is None:
                seen += "; lse layout/base unknown"
            else:
                _, without = _oracle(case, sink_in_lse=False)
                lse_seen = ("lse includes it" if _close(t, ref_lse, self.dtype) else
                            "lse leaves it out" if _close(t, without, self.dtype) else "lse matches neither")
                seen += f"; {lse_seen}"
                ok = ok and lse_seen == "lse includes it"
        self.add("sinks_in_lse", ok, expected, seen, case)

    def empty_keys(self) -> None:
        expected = "Nk = 0: zeros, lse -inf"
        case = self.case(B=1, Hq=2, Hkv=2, Nq=3, Nk=0,
                         options={"return_lse": True} if "return_lse" in self.accepts else {})
        out, lse = self.run(case)
        o = out.detach().double().cpu()
        seen = ("NaN" if bool(torch.isnan(o).any()) else "zeros" if bool((o == 0).all()) else "garbage")
        if tuple(o.shape) != (1, 2, 3, 16):
            seen = f"shape {tuple(o.shape)}"
        ok = seen == "zeros"
        if lse is not None:
            t = self.lse.normalize(lse, 1, 2, 3)
            if t is not None:
                good = bool(torch.isneginf(t).all())
                seen += ", lse -inf" if good else ", lse " + ("NaN" if bool(torch.isnan(t).any()) else "finite")
                ok = ok and good
        self.add("empty_keys", ok, expected, seen, case)

    def dtype_check(self) -> None:
        expected = "out in the input dtype, lse float32 (float64 for float64), within tolerance"
        seen, ok, bad = [], True, None
        for dt in self.dtypes:
            name = str(dt).replace("torch.", "")
            case = self.case(B=1, Hq=2, Hkv=2, Nq=5, Nk=7, dtype=name,
                             options={"return_lse": True} if "return_lse" in self.accepts else {})
            try:
                out, lse = self.run(case)
            except Exception as e:
                seen.append(f"{name}: raised {type(e).__name__}")
                ok, bad = False, bad or case
                continue
            want_lse = torch.float64 if dt == torch.float64 else torch.float32
            good = out.dtype == dt and (lse is None or lse.dtype == want_lse)
            ref, _ = _oracle(case)
            close = _close(out, ref, dt)
            part = f"{name}: out {str(out.dtype).replace('torch.', '')}"
            if lse is not None:
                part += f", lse {str(lse.dtype).replace('torch.', '')}"
            seen.append(part + ("" if close else f", error {_err(out, ref):.3g}"))
            if not (good and close):
                ok, bad = False, bad or case
        self.add("dtype", ok, expected, "; ".join(seen), bad)

    def single_query(self) -> None:
        expected = "Nq = 1 (decode) matches the reference"
        options = {"causal": True} if "causal" in self.accepts else {}
        case = self.case(B=2, Hq=2, Hkv=2, Nq=1, Nk=9, options=options)
        out, _ = self.run(case)
        ref, _ = _oracle(case)
        e = _err(out, ref)
        self.add("single_query", e <= _TOL[self.dtype], expected, f"error {e:.3g}", case)

    def noncontiguous(self) -> None:
        expected = "strided views give the same result as contiguous tensors"
        case = self.case(B=2, Hq=2, Hkv=2, Nq=6, Nk=6)
        q, k, v, _ = case.tensors(self.device)
        views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # (B, N, H, D) storage
        out, _ = call(self.fn, *views)
        ref, _ = _oracle(case)
        e = _err(out, ref)
        self.add("noncontiguous", e <= _TOL[self.dtype], expected, f"error {e:.3g}", case,
                 note="q, k, v stored (B, N, H, D) and viewed (B, H, N, D)")

    def determinism(self) -> None:
        expected = "bitwise identical over repeated calls"
        case = self.case(B=2, Hq=2, Hkv=2, Nq=16, Nk=16)
        outs = [self.run(case)[0].detach().cpu() for _ in range(3)]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        diff = max(float((outs[0].double() - o.double()).abs().max()) for o in outs[1:])
        self.add("determinism", same, expected, "bitwise identical" if same else f"differ by up to {diff:.3g}", case)

    def batch_invariance(self) -> None:
        expected = "each row bitwise the same alone, in another batch, and prefilled in chunks"
        r = check_batch_invariance(self.fn, device=self.device, dtype=self.dtype, seed=self.seed)
        self.add("batch_invariance", r.ok, expected, r.describe(), None, note=r.input)


def _oracle_scaled(case: Case, factor: float, **kw):
    """The oracle on the case's tensors multiplied by ``factor`` (softcap needs large scores)."""
    class _Scaled(Case):
        def tensors(self, device="cpu"):
            q, k, v, s = super().tensors(device)
            return q * factor, k * factor, v * factor, s
    return _oracle(_Scaled(**case.as_dict()), **kw)


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text[:160]


CHECKS = ("lse_layout", "lse_base", "values", "causal_alignment", "masked_rows", "window", "gqa_mapping",
          "softcap_order", "sinks_in_lse", "empty_keys", "dtype", "single_query", "noncontiguous", "determinism",
          "batch_invariance")

_EXPECTED = {
    "lse_layout": QKV_LAYOUT, "lse_base": QKV_LSE, "values": "matches the float64 reference",
    "causal_alignment": "bottom-right", "masked_rows": "zeros, lse -inf", "window": "bottom-right, inclusive",
    "gqa_mapping": "h // group", "softcap_order": "capped, then masked", "sinks_in_lse": "included",
    "empty_keys": "zeros, lse -inf", "dtype": "input dtype, lse float32", "single_query": "matches the reference",
    "noncontiguous": "same as contiguous", "determinism": "bitwise identical", "batch_invariance": "bitwise invariant",
}


def run_battery(fn: PlainFn, *, device="cpu", dtypes=(torch.float32,), seed: int = 0,
                checks: tuple[str, ...] | None = None) -> list[Finding]:
    """Every check on ``fn`` (or those named in ``checks``); one or more findings per check."""
    bat = _Battery(fn, device, dtypes, seed)
    steps = {"lse_layout": bat.probe_lse, "values": bat.values, "causal_alignment": bat.causal_alignment,
             "masked_rows": bat.masked_rows, "window": bat.window, "gqa_mapping": bat.gqa_mapping,
             "softcap_order": bat.softcap_order, "sinks_in_lse": bat.sinks_in_lse, "empty_keys": bat.empty_keys,
             "dtype": bat.dtype_check, "single_query": bat.single_query, "noncontiguous": bat.noncontiguous,
             "determinism": bat.determinism, "batch_invariance": bat.batch_invariance}
    wanted = CHECKS if checks is None else checks
    for name in wanted:
        if name not in CHECKS:
            raise ValueError(f"conformance: unknown check {name!r}; valid: {', '.join(CHECKS)}")
    for name in ("lse_layout", *[c for c in CHECKS if c not in ("lse_layout", "lse_base")]):
        # the lse probe always runs (later checks read the lse through it); masked rows need the alignment
        if name in wanted or name == "lse_layout" or (name == "causal_alignment" and "masked_rows" in wanted):
            bat.guarded(name, _EXPECTED[name], steps[name])
    order = {c: i for i, c in enumerate(CHECKS)}
    return sorted((f for f in bat.findings if f.check in wanted), key=lambda f: order[f.check])
