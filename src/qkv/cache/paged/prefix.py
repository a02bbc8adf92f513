"""Prefix keys of paged storage: a SHA-256 hash chain over the token ids of a row's full blocks, seeded with an
optional salt so tenants never share blocks (automatic prefix caching as in vLLM, Kwon et al. 2023,
arXiv:2309.06180, and SGLang's RadixAttention, Zheng et al. 2023, arXiv:2312.07104)."""

from __future__ import annotations

import hashlib

__all__ = ["prefix_hashes", "salt_bytes", "extend_chain"]


def salt_bytes(salt) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return salt.encode()
    raise TypeError(f"salt: expected bytes, str or None, got {type(salt).__name__}")


def prefix_hashes(token_ids: list[int], block_size: int, *, salt=None) -> list[bytes]:
    """SHA-256 hash chain of the full blocks of ``token_ids``: block ``j``'s key covers tokens
    ``0 .. (j + 1) * block_size - 1`` and the salt, so equal keys mean equal prefixes.

    Example:
        >>> a = prefix_hashes(list(range(40)), 16)
        >>> len(a), a == prefix_hashes(list(range(32)) + [7] * 8, 16)
        (2, True)
    """
    return extend_chain([], token_ids, block_size, salt_bytes(salt))


def extend_chain(chain: list[bytes], token_ids: list[int], block_size: int, salt: bytes) -> list[bytes]:
    """``chain`` extended to every full block of ``token_ids`` (its existing keys are kept)."""
    out = list(chain)
    parent = out[-1] if out else hashlib.sha256(b"qkv-prefix:" + salt).digest()
    for j in range(len(out), len(token_ids) // block_size):
        block = token_ids[j * block_size:(j + 1) * block_size]
        h = hashlib.sha256(parent)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in block))
        parent = h.digest()
        out.append(parent)
    return out
