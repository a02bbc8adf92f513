"""Sphinx configuration of qkv's documentation site (``make docs``; ``docs/README.md`` says why Sphinx)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The executed pages' kernels inherit the environment: they import this tree's qkv, like autodoc does.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent / "src"), str(HERE / "_ext"),
                                                    os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("OMP_NUM_THREADS", "1")

project = "qkv"
author = "the qkv authors"
copyright = "the qkv authors, Apache-2.0"  # noqa: A001 (Sphinx's name)
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",
    "qkv_apigen",
]



def _source_digest() -> str:
    """A digest of qkv's sources and the docs' helpers: the execution cache is keyed on the pages' code only, so
    it lives in a folder named by this digest and any change to the library reruns every page."""
    digest = hashlib.sha256()
    for path in sorted([*(HERE.parent / "src" / "qkv").rglob("*.py"), *(HERE / "_ext").glob("*.py")]):
        digest.update(str(path.relative_to(HERE.parent)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


# Executed pages: every code cell runs at build time; a cell that raises fails the build. Results are cached in
# docs/_build/.jupyter_cache/<digest of the sources> (a page reruns when its code or qkv changes);
# QKV_DOCS_EXECUTE=force reruns them all (the tests' build does).
nb_execution_mode = os.environ.get("QKV_DOCS_EXECUTE", "cache")
qkv_source_digest = _source_digest()  # a change re-reads every page (docs/_ext/qkv_apigen.py declares it)
nb_execution_cache_path = str(HERE / "_build" / ".jupyter_cache" / qkv_source_digest)
nb_execution_raise_on_error = True
nb_execution_in_temp = True  # files a page writes (view.html, PNGs) land in a temporary folder
nb_execution_timeout = 240
nb_execution_show_tb = True
nb_merge_streams = True
nb_render_markdown_format = "myst"  # generated tables (the matrices page) are Markdown outputs
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
exclude_patterns = ["_build", "README.md", "Thumbs.db", ".DS_Store"]

autodoc_typehints = "none"  # shapes and dtypes are in the docstrings' Args; torch's types have no target here
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # torch.nn.Module.forward's docstring is not ours
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Strict: `make docs` passes -W -n, so a warning or a broken cross-reference fails the build. Names outside the
# documented surface (torch's, the standard library's, qkv's private modules) have no page here to link to.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|collections|numpy|np|transformers|triton|pathlib|enum|abc|dataclasses)(\..*)?"),
    (r"py:.*", r"qkv\.(_\w+|spec|pos|testing|integrations|cli|plain)(\..*)?"),
    (r"py:.*", r"qkv(\.\w+)*\._\w+.*"),
    (r"py:class", r"(int|float|str|bool|bytes|dict|list|tuple|set|callable|optional|None|Any|Callable|Tensor)"),
]

html_theme = "furo"
html_title = "qkv"
html_static_path: list[str] = []
html_show_sourcelink = False
html_copy_source = False
