"""CPU speed paths, a layer of their own: the products a CPU decode or embedding step spends its time in,
applied to a plain model from outside by one call, :func:`optimize`.

- :mod:`qkv.cpu.rule`: which product path a shape takes (one table, following the measurements in
  ``benchmarks/results/skinny.json``).
- :mod:`qkv.cpu.skinny`: few-row products (a decode step) cut into blocks of the weight and spread over
  torch's threads.
- :mod:`qkv.cpu.gemm`: many-row products through oneDNN with weights packed once, and :func:`~qkv.cpu.gemm.linear`,
  the product the rule picks. It relies on private ``torch.ops.mkldnn`` operators, so it runs only where
  :func:`~qkv.cpu.gemm.onednn_unavailable_reason` finds them working in this torch; elsewhere the rule falls
  back to the blocks and ``F.linear``.
- :mod:`qkv.cpu.kernels`: qkv's compiled C++ kernels (``csrc/``), built on first use: attention over listed keys
  read in place (the gather backend's and the paged decode step's CPU path), the chunked gated delta rule a
  chunk at a time in cache (``qkv.linear.gated_delta_chunked`` without autograd), and a gated-delta mixer's whole
  decode step after its projections (``qkv.nn.GatedDeltaNet`` / ``KimiDeltaAttention``).
- :mod:`qkv.cpu.greedy`: greedy tokens of an LM head through an int8 screen with a rigorous bound, the few
  tokens it leaves recomputed in float64 (:class:`~qkv.cpu.greedy.HeadScreen`; ``DecoderLM.next_tokens``).
- :mod:`qkv.cpu.optimize`: :func:`optimize` swaps these into a model (``qkv.models.from_hf``,
  ``qkv.models.generate`` and ``SentenceEncoder`` call it by default); :func:`use_onednn` is the same with
  oneDNN required, kept for existing code.

Whatever the layout in memory, a model's ``state_dict()`` holds standard contiguous tensors, so
``safetensors.torch.save_file(model.state_dict(), path)`` works as is. Measured speed-ups are in
``benchmarks/RESULTS.md``.
"""

from .gemm import (
    LinearProducts,
    PrepackedLinear,
    PrepackedWeight,
    PrepackedWeights,
    onednn_available,
    onednn_unavailable_reason,
)
from .greedy import GreedyHead, HeadScreen, screen_unavailable_reason
from .optimize import ActivatedUpProjection, LinearHost, Optimized, optimize, optimized, use_onednn
from .skinny import InputMajorLinear, SkinnyLinear, input_major, skinny_linear

__all__ = ["optimize", "optimized", "Optimized", "use_onednn", "LinearHost", "ActivatedUpProjection", "GreedyHead",
           "HeadScreen", "screen_unavailable_reason",
           "onednn_available", "onednn_unavailable_reason", "PrepackedLinear", "PrepackedWeight",
           "PrepackedWeights", "LinearProducts", "SkinnyLinear", "InputMajorLinear", "input_major", "skinny_linear"]
