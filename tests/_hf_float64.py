"""HF modeling files with their float32 islands lifted to float64, as float64 references.

Some HF models compute parts of every forward in float32 whatever the model's dtype (DeepSeek-V4: its RMSNorms, rotary
angles, hyper-connection weights, compressor softmax and indexer scores call ``.float()`` or ``.to(torch.float32)``),
so ``model.double()`` is accurate only to float32 there and cannot serve as a float64 reference. :func:`float64_module`
loads HF's own source with exactly those casts turned into float64 ones (a textual substitution whose count is
checked, so a changed HF file fails loudly instead of silently staying float32) and returns it as a module: the same
HF math, in float64 throughout.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

__all__ = ["float64_module"]

_LIFTS = ((".to(torch.float32)", ".to(torch.float64)"), (".float()", ".double()"),
          ("dtype=torch.float32", "dtype=torch.float64"), ("dtype=torch.float)", "dtype=torch.float64)"))


def float64_module(family: str, expected: dict[str, int]) -> types.ModuleType:
    """``transformers.models.<family>.modeling_<family>`` with every float32 cast of :data:`_LIFTS` made float64.

    Args:
        family: the HF model directory, e.g. ``"deepseek_v4"``.
        expected: how many times each cast (a key of ``_LIFTS``' first column) occurs in the file; a
            ``RuntimeError`` when HF's file differs, so the test is revisited.
    """
    name = f"transformers.models.{family}.modeling_{family}_float64"
    if name in sys.modules:
        return sys.modules[name]
    package = f"transformers.models.{family}"
    path = Path(importlib.import_module(package).__file__).with_name(f"modeling_{family}.py")
    src = path.read_text()
    for old, new in _LIFTS:
        seen = src.count(old)
        if seen != expected.get(old, 0):
            raise RuntimeError(f"{path}: {seen} occurrences of {old!r}, expected {expected.get(old, 0)}; HF's file "
                               "changed, check which float32 islands remain before trusting the float64 reference")
        src = src.replace(old, new)
    module = types.ModuleType(name)
    module.__package__, module.__file__ = package, str(path)
    sys.modules[name] = module
    exec(compile(src, str(path), "exec"), module.__dict__)
    return module
