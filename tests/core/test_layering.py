"""The import graph stays layered: every import of one qkv package from another points down the table below
(the README's layout table), lazy imports inside functions included, and no two packages of one layer import
each other. A new package must be placed in the table, or this test names it."""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

SRC = Path(qkv.__file__).resolve().parent

#: Layer of each top-level package or module of qkv; an import may only point to a lower layer (or, inside the
#: functional core, across it: the operator, its shared types and its backends are one layer).
CORE = 1
LAYERS: dict[str, float] = {
    "config": 0, "costs": 0.5, "cpu": 0.5,  # the model description; arithmetic on it; CPU products (imports no qkv)
    "spec": 0.1,  # qkv.config's deprecated alias (one release)
    **dict.fromkeys(["_attention", "_request", "_paged", "_merge", "_probs", "_dropout", "_layout", "_sinks", "lse",
                     "masks", "mods", "pos", "varlen", "backends", "linear", "testing", "plain", "sparse"], CORE),
    "cache": 2,
    "nn": 3,
    "distributed": 4, "interpret": 4,
    "models": 5,
    "integrations": 6, "conformance": 6.5,
    "cli": 7,
}


def _package(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    return rel.parts[0] if rel.parts[0] != "__init__" else "__init__"


def _targets(source: str, here: list[str]) -> set[str]:
    """Top-level qkv packages that ``source`` (a file in the package folder ``here``, e.g. ``["nn"]``) imports, at
    any depth of the file (lazy imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    found.add(parts[0])
                else:  # "from . import x" at the top of the package
                    found.update(a.name for a in node.names)
            elif node.module and (node.module == "qkv" or node.module.startswith("qkv.")):
                parts = node.module.split(".")[1:]
                found.update([parts[0]] if parts else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("qkv."))
    return found


def _edges() -> dict[str, set[tuple[str, str]]]:
    edges: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = _package(path)
        for tgt in _targets(path.read_text(), list(path.relative_to(SRC).parent.parts)) - {src}:
            edges.setdefault(src, set()).add((tgt, str(path.relative_to(SRC))))
    return edges


def test_every_package_has_a_layer():
    packages = {_package(p) for p in SRC.rglob("*.py")} - {"__init__"}
    missing = sorted(packages - set(LAYERS))
    assert not missing, f"place these qkv packages in LAYERS (and the README's layout table): {missing}"


def test_imports_point_down():
    upward = []
    for src, targets in _edges().items():
        if src == "__init__":  # the package root is the public face: it re-exports from every layer
            continue
        for tgt, where in sorted(targets):
            if tgt not in LAYERS:
                continue
            a, b = LAYERS[src], LAYERS[tgt]
            if b > a or (b == a and a != CORE):
                upward.append(f"{where}: {src} (layer {a}) imports {tgt} (layer {b})")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_the_layer_check_sees_lazy_and_relative_imports():
    source = "import torch\ndef f():\n    from ..cli import main\n    import qkv.models.generate\nfrom . import x\n"
    assert _targets(source, ["nn"]) == {"cli", "models", "nn"}
    assert _targets("from ...masks import causal\n", ["backends", "triton"]) == {"masks"}


#: Packages that compute with plain torch (or ``qkv.attention``): qkv's compiled CPU kernels are put into their
#: modules from outside by ``qkv.cpu.optimize``, so none of them imports ``qkv.cpu`` (not even for a type).
PLAIN_TORCH = ("nn", "pos", "linear", "cache")


def test_plain_torch_packages_import_nothing_from_cpu():
    edges = _edges()
    found = sorted(f"{where}: {src} imports cpu" for src in PLAIN_TORCH for tgt, where in edges.get(src, ())
                   if tgt == "cpu")
    assert not found, "speed is applied from outside (qkv.cpu.optimize); these import qkv.cpu:\n" + "\n".join(found)


def test_only_cpu_loads_the_kernels():
    """``kernels.load()`` is qkv.cpu's own: everything else reaches the kernels through ``qkv.cpu.ops``."""
    found = sorted(str(p.relative_to(SRC)) for pkg in PLAIN_TORCH for p in (SRC / pkg).rglob("*.py")
                   if "kernels.load" in p.read_text())
    assert not found, f"call qkv.cpu.ops (or take a kernel slot qkv.cpu.optimize fills) instead: {found}"


def test_the_cpu_rule_sees_a_type_only_import():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cpu.greedy import HeadScreen\n"
    assert "cpu" in _targets(source, ["nn"])


#: Packages that must not import some packages of lower layers: the rule, and why.
FORBIDDEN: dict[str, dict[str, str]] = {
    "cache": {"cpu": "compiled kernels are applied from outside (qkv.cpu.optimize) or run by a registered backend",
              "backends": "the cache hands block-pool operands to qkv.attention (qkv.PagedKV) and writes through "
                          "qkv._paged; the paged backend serves them"},
}


def test_forbidden_imports():
    """qkv.cache imports neither qkv.cpu nor qkv.backends (lazy imports included)."""
    found = [f"{where}: {src} imports {tgt} ({why})" for src, rules in FORBIDDEN.items()
             for tgt, where in sorted(_edges().get(src, ())) if (why := rules.get(tgt))]
    assert not found, "forbidden imports:\n" + "\n".join(found)


def test_the_forbidden_rule_sees_a_lazy_backend_import():
    assert "backends" in _targets("def f():\n    from ...backends.paged import gather_head_major\n",
                                  ["cache", "paged"])

