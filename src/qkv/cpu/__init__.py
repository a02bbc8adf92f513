"""CPU speed paths, a layer of their own: the products a CPU decode or embedding step spends its time in.

- :mod:`qkv.cpu.skinny`: few-row products (a decode step) cut into blocks of the weight and spread over
  torch's threads (:class:`~qkv.cpu.skinny.SkinnyLinear`, which :class:`qkv.nn.DecoderLM` uses for every
  projection; :class:`~qkv.cpu.skinny.InputMajorLinear` with ``input_major_weights``).
- :mod:`qkv.cpu.gemm`: several-row products through oneDNN with weights prepacked once
  (:func:`~qkv.cpu.gemm.use_onednn`, the one call that applies it to a model; ``SentenceEncoder`` does by
  default). It relies on private ``torch.ops.mkldnn`` operators, so it runs only where
  :func:`~qkv.cpu.gemm.onednn_unavailable_reason` finds them working in this torch; elsewhere every product
  falls back to ``F.linear``.

Whatever the layout in memory, a model's ``state_dict()`` holds standard contiguous tensors, so
``safetensors.torch.save_file(model.state_dict(), path)`` works as is. Measured speed-ups are in
``benchmarks/RESULTS.md``.
"""

from .gemm import PrepackedLinear, PrepackedWeight, onednn_available, onednn_unavailable_reason, use_onednn
from .skinny import InputMajorLinear, SkinnyLinear, input_major, skinny_linear

__all__ = ["use_onednn", "onednn_available", "onednn_unavailable_reason", "PrepackedLinear", "PrepackedWeight",
           "SkinnyLinear", "InputMajorLinear", "input_major", "skinny_linear"]
