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
- :mod:`qkv.cpu.kernels`: qkv's compiled C++ kernels (``csrc/``) as torch operators ``torch.ops.qkv_cpu.<name>``,
  prebuilt in the wheel (one library per CPU capability) or built by JIT on first use; :mod:`qkv.cpu.ops` is the
  one facade the rest of qkv calls (a function per operator and its ``why_not_*`` eligibility test),
  :mod:`qkv.cpu.fakes` their shapes for FakeTensor tracing and ``torch.compile``, and ``qkv doctor`` shows their
  state. Attention over listed keys read in place (the gather backend), a cached decode step (the ``cpu_decode``
  backend), the paged cache's steps, the chunked gated delta rule, a gated-delta mixer's decode step, RMSNorm,
  SwiGLU's gate, rotary embeddings and routed experts.
- :mod:`qkv.cpu.fused`: those kernels in the form :func:`optimize` puts into a plain model's kernel slots.
- :mod:`qkv.cpu.greedy`: greedy tokens of an LM head through an int8 screen with a rigorous bound, the few
  tokens it leaves recomputed in float64 (:class:`~qkv.cpu.greedy.HeadScreen`; ``DecoderLM.next_tokens``).
- :mod:`qkv.cpu.weights`: few-row products with bfloat16 weights, or int8 weights with per-channel scales
  (:class:`~qkv.cpu.weights.Int8Linear`; ``optimize(model, weights="int8")``, never the default), and float32
  weights of bfloat16 values held in bfloat16, losslessly (``optimize(model, weights="bf16-exact")``).
- :mod:`qkv.cpu.optimize`: :func:`optimize` swaps these into a model (``qkv.models.from_hf``,
  ``qkv.models.generate`` and ``SentenceEncoder`` call it by default); :func:`use_onednn` is the same with
  oneDNN required, kept for existing code.
- :mod:`qkv.cpu.threads`: each step of an optimized model on no more of torch's threads than the cores other
  processes leave free (:func:`step`; ``optimize(model, threads="fixed")``: torch's setting).

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
from .optimize import ActivatedUpProjection, LinearHost, Optimized, optimize, optimized, step, use_onednn
from .skinny import InputMajorLinear, SkinnyLinear, input_major, skinny_linear
from .weights import Bf16ExactLinear, Int8Linear, is_bf16_exact, quantize_int8, weight_linear

__all__ = ["optimize", "optimized", "Optimized", "step", "use_onednn", "LinearHost", "ActivatedUpProjection",
           "GreedyHead", "HeadScreen", "screen_unavailable_reason",
           "onednn_available", "onednn_unavailable_reason", "PrepackedLinear", "PrepackedWeight",
           "PrepackedWeights", "LinearProducts", "SkinnyLinear", "InputMajorLinear", "input_major", "skinny_linear",
           "Int8Linear", "Bf16ExactLinear", "is_bf16_exact", "quantize_int8", "weight_linear"]
