"""Findings and the report: a table for people, JSON for machines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["Finding", "Report"]


@dataclass
class Finding:
    """One check's verdict. ``ok`` is True (as qkv's contract says), False (differs: ``seen`` says how) or
    None (not supported by the callable, or not testable with what it takes). ``input`` is the reproducing
    case (``qkv.conformance.Case(**input).tensors()`` rebuilds the tensors)."""

    check: str
    ok: bool | None
    expected: str
    seen: str
    input: dict | None = None
    note: str = ""


@dataclass
class Report:
    """What :func:`qkv.conformance.check` found about one attention callable."""

    name: str
    device: str
    dtypes: list[str]
    supports: list[str]
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No finding differs from the contract (unsupported options do not count)."""
        return all(f.ok is not False for f in self.findings)

    def failed(self) -> list[str]:
        """Names of the checks that differ from the contract."""
        return [f.check for f in self.findings if f.ok is False]

    def finding(self, check: str) -> Finding:
        """The finding of the check called ``check``."""
        for f in self.findings:
            if f.check == check:
                return f
        raise KeyError(f"report for {self.name!r} has no finding {check!r}; it has {[f.check for f in self.findings]}")

    def to_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "dtypes": self.dtypes, "supports": self.supports,
                "ok": self.ok, "findings": [asdict(f) for f in self.findings]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        """A plain-text table: check, verdict, expected, seen."""
        rows = [("check", "result", "expected", "seen")]
        for f in self.findings:
            rows.append((f.check, verdict(f.ok), f.expected, f.seen))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"conformance of {self.name} on {self.device} ({', '.join(self.dtypes)}); "
                 f"takes: {', '.join(self.supports) or 'no options'}"]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def verdict(ok: bool | None) -> str:
    return "ok" if ok is True else "DIFFERS" if ok is False else "n/a"
