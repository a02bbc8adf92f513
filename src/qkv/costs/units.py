"""Parsing and formatting for cost arithmetic: context lengths, storage dtypes, bytes and FLOPs.

Context lengths follow the model-card convention: ``128k`` is 131,072 tokens (``k`` = 1024,
``M`` = 1024**2). A plain integer is taken as written, so the decimal "128K" of some texts is
``128000``. Bytes are reported both in decimal units (GB = 1e9 bytes, as GPU memory is sold) and
binary units (GiB = 2**30 bytes, as ``torch.cuda.mem_get_info`` counts).
"""

from __future__ import annotations

import re

__all__ = ["DTYPE_BYTES", "GB", "GiB", "MAX_CONTEXT", "format_bytes", "format_flops", "parse_context", "parse_dtype"]

GB = 10**9
GiB = 2**30

# Bytes per stored element. Sub-byte integers pack 2 (int4) or 4 (int2) elements per byte.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "int2": 0.25,
}
_DTYPE_ALIASES = {
    "float32": "fp32", "f32": "fp32", "float": "fp32",
    "float16": "fp16", "f16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "uint8": "int8",
    "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}

_CONTEXT_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmM]?)")
_MULTIPLIER = {"": 1, "k": 1024, "m": 1024**2}
#: The longest context parsed (2**40 tokens): one rule for every spelling, so ``99999999999999999999999M`` is
#: refused like ``1e30``.
MAX_CONTEXT = 2**40
_CONTEXT_FORMS = (
    "a positive integer (131072, 131_072, 131,072) or a number with a binary suffix "
    "k = 1024 or M = 1024**2 (128k = 131072, 1.5k = 1536, 1M = 1048576), at most 2**40 tokens"
)


def parse_context(text: str | int) -> int:
    """Parse a context length in tokens.

    Args:
        text: ``131072``, ``"131_072"``, ``"131,072"``, ``"128k"``/``"128K"`` (x 1024), ``"1M"``
            (x 1024**2), or a decimal with a suffix whose value is a whole number (``"1.5k"``).

    Returns:
        The number of tokens, a positive ``int``.

    Raises:
        ValueError: for anything else (``"abc"``, ``"-5"``, ``"0"``, ``"1.5.3"``), listing the forms.

    Example:
        >>> parse_context("128k"), parse_context("128,000"), parse_context(2048)
        (131072, 128000, 2048)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if 0 < text <= MAX_CONTEXT:
            return text
    elif isinstance(text, str):
        m = _CONTEXT_RE.fullmatch(text.strip().replace("_", "").replace(",", ""))
        if m:
            number, suffix = m.groups()
            mult = _MULTIPLIER[suffix.lower()]
            whole, _, frac = number.partition(".")
            # Exact integer arithmetic: "1.5k" is 15 * 1024 / 10, refused unless it divides evenly.
            num, den = int(whole + frac) * mult, 10 ** len(frac)
            if num > 0 and num % den == 0 and num // den <= MAX_CONTEXT:
                return num // den
    raise ValueError(f"context length {text!r} not understood; use {_CONTEXT_FORMS}")


def parse_dtype(name: str) -> float:
    """Bytes per element of a cache storage dtype.

    Args:
        name: one of ``fp32 fp16 bf16 fp8 int8 int4 int2`` (case-insensitive; ``float16``,
            ``bfloat16``, ``half``, ``e4m3`` and similar aliases are accepted).

    Returns:
        Bytes per element: 4, 2, 2, 1, 1, 0.5, 0.25. Group scales of quantized formats are not
        included; see ``group_size`` in :func:`qkv.costs.kv_cache_memory`.

    Example:
        >>> parse_dtype("bf16"), parse_dtype("int4")
        (2.0, 0.5)
    """
    return DTYPE_BYTES[_dtype_key(name)]


def _dtype_key(name: str) -> str:
    """The canonical short name (``"bfloat16"`` -> ``"bf16"``); ValueError listing the names."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} not understood; use one of {', '.join(DTYPE_BYTES)}")
    return key


def _scaled(value: float, base: int, units: tuple[str, ...], digits: int) -> str:
    for unit in units[:-1]:
        if abs(value) < base:
            return f"{value:g} {unit}" if unit == units[0] else f"{value:.{digits}f} {unit}"
        value /= base
    return f"{value:.{digits}f} {units[-1]}"


def format_bytes(num_bytes: float, *, binary: bool = False, digits: int = 2) -> str:
    """Format a byte count with the largest unit that keeps the number at least 1.

    Args:
        num_bytes: a byte count.
        binary: ``False`` for decimal units (kB, MB, GB = 1e9, TB), ``True`` for binary units
            (KiB, MiB, GiB = 2**30, TiB).
        digits: digits after the decimal point.

    Example:
        >>> format_bytes(4_194_304_000), format_bytes(4_194_304_000, binary=True)
        ('4.19 GB', '3.91 GiB')
    """
    if binary:
        return _scaled(num_bytes, 1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"), digits)
    return _scaled(num_bytes, 1000, ("B", "kB", "MB", "GB", "TB", "PB"), digits)


def format_flops(flops: float, *, digits: int = 2) -> str:
    """Format a FLOP count with decimal prefixes.

    Example:
        >>> format_flops(3.5e15)
        '3.50 PFLOP'
    """
    return _scaled(flops, 1000, ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"), digits)
