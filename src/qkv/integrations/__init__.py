"""qkv inside other libraries: ``qkv.integrations.transformers`` (an HF attention implementation).

Each integration imports its library lazily, on import of its own module.
"""

__all__: list[str] = []
