"""``qkv conform``: run the conformance battery (:mod:`qkv.conformance`) on a named kernel or on the user's own
(``module:function`` or ``path/to/file.py:function``, the plain signature of :mod:`qkv.plain`)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "conform", "load_user_kernel"]


def conform(
    names: Annotated[list[str], typer.Argument(help="Adapter names: sdpa, flex, hf-eager, hf-sdpa, reference, "
                                                    "tiled, qkv-sdpa, qkv-flex, triton, tiled-invariant, varlen, "
                                                    "fa2, fa3, fa4, fa2-varlen, flashinfer, flashinfer-ragged; or "
                                                    "your own kernel as module:function or path/to/file.py:function, "
                                                    "called with q, k, v of shape (B, H, N, D) and the keywords it "
                                                    "takes (causal, scale, window, softcap, return_lse).")],
    device: Annotated[str, typer.Option(help="Device for the inputs.")] = "cpu",
    dtypes: Annotated[str, typer.Option(help="Comma-separated dtypes for the dtype check.")] = "float32",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the reports as JSON here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every input.")] = 0,
) -> None:
    """Check attention kernels against qkv's contract: lse base and layout, fully masked rows, causal and
    window alignment, GQA mapping, softcap order, sinks, empty keys, dtypes, determinism, batch invariance.

    Examples:

        qkv conform sdpa hf-eager

        qkv conform tiled --dtypes float32,bfloat16 --json conformance.json

        qkv conform mykernels:my_attention          # a module importable from here

        qkv conform kernels/attn.py:my_attention    # a file
    """
    import torch

    from qkv import conformance
    from qkv.conformance import adapters

    bad = [n for n in names if n not in adapters.ADAPTERS and ":" not in n]
    if bad:
        raise typer.BadParameter(f"unknown kernel(s) {', '.join(bad)}; valid: {', '.join(adapters.ADAPTERS)}, or "
                                 f"your own as module:function or path/to/file.py:function")
    kernels = {n: load_user_kernel(n) for n in names if n not in adapters.ADAPTERS}
    try:
        dts = [getattr(torch, d.strip()) for d in dtypes.split(",")]
        if not all(isinstance(d, torch.dtype) for d in dts):
            raise AttributeError
    except AttributeError:
        raise typer.BadParameter(f"--dtypes: {dtypes!r} is not a list of torch dtypes (e.g. float32)") from None
    reports = []
    for name in names:
        try:
            report = conformance.check(kernels.get(name, name), device=device, dtypes=dts, seed=seed, name=name)
        except ImportError as e:
            typer.echo(f"{name}: skipped ({e})")
            continue
        except ValueError as e:  # a device this torch cannot reach, ...: one line, exit code 2
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=2) from None
        reports.append(report)
        typer.echo(report.table())
        typer.echo("")
    if json_out is not None:
        json_out.write_text(json.dumps([r.to_dict() for r in reports], indent=1) + "\n")
        typer.echo(f"wrote {json_out}")


def load_user_kernel(spec: str) -> Callable:
    """The function ``spec`` names: ``module:function`` (imported as ``python -m`` would, the current directory
    first on the path) or ``path/to/file.py:function`` (a dotted ``function`` reaches an attribute of an object in
    it). ``typer.BadParameter`` naming the spec and the fix when it cannot be loaded or is not callable."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise typer.BadParameter(f"{spec!r}: give your kernel as module:function or path/to/file.py:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise typer.BadParameter(f"{spec!r}: no file {path}; give path/to/file.py:function")
        module_name = f"_qkv_user_kernel_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        if loader is None or loader.loader is None:
            raise typer.BadParameter(f"{spec!r}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise typer.BadParameter(f"{spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise typer.BadParameter(f"{spec!r}: no module {e.name!r} on the path (run from the folder that holds "
                                     f"it, or give path/to/file.py:function)") from None
        except Exception as e:
            raise typer.BadParameter(f"{spec!r}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise typer.BadParameter(f"{spec!r}: {where} has no {attr!r}; its public callables: "
                                     f"{', '.join(found) or 'none'}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise typer.BadParameter(f"{spec!r}: {attr} is a {type(fn).__name__}, not a function; give the attention "
                                 f"function fn(q, k, v, *, causal=False, scale=None, ...)")
    return fn


def register(app: typer.Typer) -> None:
    app.command("conform")(conform)
