"""Writes the API reference's pages before Sphinx reads the sources: one page per public module, one entry per
name in the module's ``__all__`` (so a name added to ``__all__`` appears by itself, and one removed disappears).

An object exported by several modules (``qkv.nn`` re-exports the model description, ``qkv.costs`` too) is
documented once, where it is met first in :data:`MODULES` order; the other modules list it with a link, so a
short cross-reference never has two targets. A module named in an ``__all__`` gets its own page.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path

__all__ = ["MODULES", "public_names", "write_pages", "setup"]

#: The documented modules, in the order their pages are listed (and objects claimed).
MODULES = ["qkv", "qkv.masks", "qkv.mods", "qkv.nn", "qkv.cache", "qkv.models", "qkv.linear", "qkv.sparse",
           "qkv.conformance", "qkv.distributed", "qkv.interpret", "qkv.costs", "qkv.cpu"]


def public_names(module: types.ModuleType) -> list[str]:
    """``module.__all__``; a public module without one is an error (it is the contract of what is public)."""
    names = getattr(module, "__all__", None)
    if names is None:
        raise RuntimeError(f"{module.__name__} has no __all__: the API reference documents exactly __all__")
    return list(names)


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "autoclass"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj) or (
            callable(obj) and hasattr(obj, "__wrapped__")):
        return "autofunction"
    return "autodata"


def _title(text: str) -> str:
    return f"{text}\n{'=' * len(text)}\n"


def write_pages(out: Path) -> list[str]:
    """Write ``out/<module>.rst`` for every documented module and ``out/index.rst``; return the module names."""
    out.mkdir(parents=True, exist_ok=True)
    queue, done, owner = list(MODULES), [], {}
    pages: dict[str, str] = {}
    while queue:
        name = queue.pop(0)
        if name in done:
            continue
        done.append(name)
        module = importlib.import_module(name)
        doc = (inspect.getdoc(module) or "").strip().splitlines()
        lines = [_title(f"``{name}``"), f".. py:module:: {name}", ""]
        if doc:
            lines += [f".. currentmodule:: {name}", "", f"{doc[0]}", ""]
        entries = []
        for attr in public_names(module):
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType):
                queue.append(obj.__name__)
                entries.append(f"- :doc:`{obj.__name__}` (module)")
                continue
            full = f"{name}.{attr}"
            key = id(obj) if not isinstance(obj, (int, float, str, bool, tuple)) else full
            if key in owner:
                entries.append(f"- ``{attr}``: the same object as :py:obj:`{owner[key]}`")
                continue
            owner[key] = full
            kind = _kind(obj)
            options = ["   :members:"] if kind == "autoclass" and not _is_tuple_class(obj) else []
            if kind == "autodata" and isinstance(obj, (dict, list, set)):
                options.append("   :no-value:")
            lines += [f".. {kind}:: {full}", *options, ""]
        if entries:
            lines += [".. rubric:: Also exported here", "", *entries, ""]
        pages[name] = "\n".join(lines)
    for name, text in pages.items():
        _write_if_changed(out / f"{name}.rst", text)
    index = [_title("API reference"),
             "Generated from the docstrings of every name in each module's ``__all__``.", "",
             ".. toctree::", "   :maxdepth: 1", "", *[f"   {name}" for name in done], ""]
    _write_if_changed(out / "index.rst", "\n".join(index))
    for stale in out.glob("*.rst"):
        if stale.stem not in done and stale.stem != "index":
            stale.unlink()
    return done


def _is_tuple_class(obj) -> bool:
    """NamedTuples: their fields are documented in the class docstring; autodoc's field entries say nothing."""
    return issubclass(obj, tuple)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _on_builder_inited(app) -> None:
    write_pages(Path(app.srcdir) / "api")


def _drop_type_docstring(app, what, name, obj, options, lines) -> None:
    """A constant without a doc comment would show its type's docstring (``dict``'s): show nothing instead."""
    own = type(obj).__doc__
    if what in ("data", "attribute") and own and "\n".join(lines).strip() == inspect.cleandoc(own).strip():
        lines.clear()


def _resolves(target: str, module: str | None) -> bool:
    """Whether ``target`` names a real Python object, as written or relative to ``module`` (or its parents)."""
    bases = [""]
    if module:
        parts = module.split(".")
        bases += [".".join(parts[:i]) + "." for i in range(len(parts), 0, -1)]
    for base in bases:
        path = (base + target).split(".")
        for cut in range(len(path), 0, -1):
            try:
                obj = importlib.import_module(".".join(path[:cut]))
            except ImportError:
                continue
            try:
                for attr in path[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return True
    return False


def _defined_in_qkv(target: str) -> bool:
    """A name written where the object it names is not importable (the torch-free ``qkv.config`` naming a
    ``qkv.nn`` function): it counts when exactly one loaded qkv module defines it."""
    head = target.partition(".")[0]
    homes = {getattr(getattr(m, head), "__module__", None) for n, m in list(sys.modules.items())
             if n.startswith("qkv.") and m is not None
             and (inspect.isclass(getattr(m, head, None)) or inspect.isfunction(getattr(m, head, None)))}
    homes.discard(None)
    return len(homes) == 1 and _resolves(target, homes.pop())


def _prose_type(target: str) -> bool:
    """Napoleon reads the text before a colon in Returns/Args as a type: ``Bytes per element``, ``0``, ``B``."""
    return " " in target or target.isdigit() or (len(target) == 1 and target.isupper())


def _unlinked_reference(app, env, node, contnode):
    """A cross-reference to a real object that has no page here (a private helper, a module outside the public
    surface) renders as code without a link; one that names nothing that exists stays a warning and, in the
    strict build, fails it."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip("~.")
    # "…:docstring of qkv.cache.cache.KVCache.update": names are also read where the docstring was written
    where = (node.source or "").rpartition("docstring of ")[2] or None
    if _prose_type(target) or any(_resolves(target, m) for m in (node.get("py:module"), where)) \
            or _defined_in_qkv(target):
        return contnode
    return None


def setup(app):
    # conf.py sets it to a digest of qkv's sources: when the library changes, every page (docstrings read by
    # autodoc, executed pages) is read again, not only the pages whose own text changed.
    app.add_config_value("qkv_source_digest", "", "env")
    app.connect("builder-inited", _on_builder_inited)
    app.connect("autodoc-process-docstring", _drop_type_docstring)
    app.connect("missing-reference", _unlinked_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
