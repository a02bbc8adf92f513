"""Context parallelism arithmetic: a layer's time on W devices per scheme, and the longest context that fits.

Pure arithmetic (no torch). The model of one attention layer on W devices, for a sequence of N tokens:

- Compute. The larger of the HBM time (this rank's Q, K, V and output once) and attention FLOPs
  ``2 * B * Hq * N^2 * (Dqk + Dv)`` (half when causal; training x 3.5, FlashAttention-2's count) over the
  device's attention throughput. Balanced layouts (zigzag, stripe, all-gather, Ulysses) give
  every rank ``1 / W`` of it; a contiguous ring under a causal mask gives the last rank ``2 / (W + 1)`` of it.
- Communication over links of ``link_bytes_per_s`` with a per-message ``latency_s``. A chunk of K/V is
  ``c = B * (N / W) * Hkv * (Dqk + Dv) * e`` bytes (MLA passes its latent, ``kv_lora_rank + qk_rope_head_dim``
  per token, and expands it locally).
  - ring / zigzag / stripe: W-1 forward steps, each overlapping one block of compute with one chunk's transfer,
    so a step costs ``max(block, c / bw + latency)``; backward W-1 steps of K/V and W of float32 dK/dV (2c).
  - allgather: one all-gather ((W-1) c sent per rank) before compute, one float32 reduce-scatter after backward.
  - ulysses: all-to-alls of Q, K, V and the output, ``(W-1) / W`` of each local tensor sent; again in backward.
  - usp: Ulysses over U ranks (U = the largest power of two <= min(8, Hkv) dividing W) and a ring over W / U.

Memory per device, training with ZeRO-3/FSDP over the W devices and full activation checkpointing:
``16 bytes * params / W`` (bf16 weights and gradients, float32 master copy and two Adam moments) plus, per local
token, the checkpointed layer inputs ``L * hidden * 2`` and one layer's recomputed working set ``34 * hidden``
(Korthikanti et al. 2023, "Reducing Activation Recomputation in Large Transformer Models", eq. 1, without
the score term FlashAttention removes), plus two K/V chunks in flight for the ring. Only ``memory_fraction`` of
the device is planned for.

Example:
    >>> from qkv.costs import PRESETS
    >>> from qkv.costs.context_parallel import H200, layer_time, longest_context
    >>> t = layer_time(PRESETS["llama-3-70b"], context=131072, world=8, scheme="zigzag", device=H200)
    >>> round(t.total_s * 1e3, 1) > 0, t.scheme
    (True, 'zigzag')
    >>> longest_context(PRESETS["llama-3-70b"], world=1, device=H200)    # 70B of training state: no room
    0
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import TRAINING_MULTIPLIER
from .presets import ModelPreset

__all__ = ["Device", "H200", "PARAMETERS", "SCHEMES", "LayerTime", "layer_time", "longest_context", "plan", "PlanRow",
           "ulysses_degree"]

SCHEMES = ("ring", "zigzag", "stripe", "allgather", "ulysses", "usp")


@dataclass(frozen=True)
class Device:
    """One accelerator: memory, HBM bandwidth, sustained attention and matmul throughput, link to its peers."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    attention_flops_per_s: float
    matmul_flops_per_s: float
    link_bytes_per_s: float
    latency_s: float


#: NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional (450 GB/s each way). Sustained
#: throughputs are assumptions: 50% (attention, FlashAttention-3's bf16 forward reaches ~75%) and 60% (GEMMs)
#: of the 989 TFLOP/s dense bf16 peak.
H200 = Device("h200", 141e9, 4.8e12, 0.5 * 989e12, 0.6 * 989e12, 450e9, 5e-6)

#: Total and active (per token) parameters of the presets the planner covers, from the model cards.
PARAMETERS: dict[str, tuple[float, float]] = {
    "llama-3-70b": (70.6e9, 70.6e9),  # meta-llama/Meta-Llama-3-70B model card
    "deepseek-v2": (236e9, 21e9),  # DeepSeek-AI 2024, arXiv:2405.04434, abstract: 236B total, 21B activated
}


@dataclass(frozen=True)
class LayerTime:
    """One attention layer on ``world`` devices; seconds, and bytes each rank sends."""

    scheme: str
    world: int
    compute_s: float  # the busiest rank's attention compute
    comm_s: float  # transfer time, overlapped or not
    total_s: float  # with the overlap the scheme allows
    bytes_sent: float  # per rank, forward (and backward when training)


def _payload_per_token(p: ModelPreset, e: float) -> float:
    """Bytes of K and V (or MLA's latent) per token that travel between ranks."""
    if p.kv_lora_rank is not None:
        return (p.kv_lora_rank + (p.qk_rope_head_dim or 0)) * e
    return p.num_key_value_heads * (p.head_dim + p.value_head_dim) * e


def ulysses_degree(p: ModelPreset, world: int) -> int:
    """Ulysses ranks of ``usp``: the largest power of two <= min(8, Hkv) that divides ``world``."""
    u = 1
    while u * 2 <= min(8, p.num_key_value_heads) and world % (u * 2) == 0:
        u *= 2
    return u


def layer_time(p: ModelPreset, *, context: int, world: int, scheme: str, device: Device, batch: int = 1,
               causal: bool = True, training: bool = True, bytes_per_element: float = 2.0,
               accumulate_bytes: float = 4.0) -> LayerTime:
    """Predicted time of one attention layer of ``p`` over ``context`` tokens on ``world`` devices.

    ``bytes_per_element``: K/V on the wire (2 for bf16); ``accumulate_bytes``: the dK/dV accumulators (float32).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"layer_time: unknown scheme {scheme!r}; choose one of {SCHEMES}")
    if world < 1 or context < world:
        raise ValueError(f"layer_time: need 1 <= world <= context, got world={world}, context={context}")
    e, bw, lat, W = bytes_per_element, device.link_bytes_per_s, device.latency_s, world
    flops_fwd = 2.0 * batch * p.num_attention_heads * context ** 2 * (p.head_dim + p.value_head_dim)
    if causal:
        flops_fwd /= 2
    share = 2 / (W + 1) if (causal and scheme == "ring") else 1 / W
    # A block is bound by its FLOPs or by reading its Q, K, V and writing its output from HBM.
    hbm = batch * (context / W) * (p.num_attention_heads + p.num_key_value_heads) * (p.head_dim + p.value_head_dim) * e
    fwd = max(flops_fwd * share / device.attention_flops_per_s, hbm / device.hbm_bytes_per_s)
    bwd = fwd * (TRAINING_MULTIPLIER - 1) if training else 0.0
    chunk = batch * (context / W) * _payload_per_token(p, e)
    local = batch * (context / W)
    if scheme in ("ring", "zigzag", "stripe", "usp"):
        U = ulysses_degree(p, W) if scheme == "usp" else 1
        R = W // U
        if p.kv_lora_rank is not None:
            chunk *= U  # MLA's latent is shared by the heads: Ulysses cannot split it
        t_c = chunk / bw + lat  # usp: each rank passes 1/U of the heads of a U-times longer chunk
        steps = R
        f_step, b_step = fwd / steps, bwd / steps
        total = f_step + (steps - 1) * max(f_step, t_c)
        sent = (steps - 1) * chunk
        comm = (steps - 1) * t_c
        if training and steps > 1:
            grad = chunk * accumulate_bytes / e  # float32 dK/dV
            t_g = grad / bw + lat
            total += b_step + (steps - 1) * max(b_step, t_c + t_g) + t_g
            sent += (steps - 1) * chunk + steps * grad
            comm += (steps - 1) * (t_c + t_g) + t_g
        elif training:
            total += b_step
        if scheme == "usp" and U > 1:
            a2a = _all_to_all(p, local, U, e) * (2 if training else 1)
            total += a2a / bw + 4 * (U - 1) * lat * (2 if training else 1)
            sent += a2a
            comm += a2a / bw
    elif scheme == "allgather":
        gather = (W - 1) * chunk
        comm = gather / bw + (W - 1) * lat
        sent = gather
        if training:
            comm += gather * accumulate_bytes / e / bw + (W - 1) * lat
            sent += gather * accumulate_bytes / e
        total = fwd + bwd + comm
    else:
        a2a = _all_to_all(p, local, W, e) * (2 if training else 1)
        comm = a2a / bw + 4 * (W - 1) * lat * (2 if training else 1)
        sent = a2a
        total = fwd + bwd + comm
    return LayerTime(scheme, W, fwd + bwd, comm, total, sent)


def _all_to_all(p: ModelPreset, local_tokens: float, ranks: int, e: float) -> float:
    """Bytes one rank sends in the four all-to-alls of Ulysses (Q, K, V, out) over ``ranks`` ranks."""
    per_token = (p.num_attention_heads * (p.head_dim + p.value_head_dim)
                 + p.num_key_value_heads * (p.head_dim + p.value_head_dim)) * e
    return local_tokens * per_token * (ranks - 1) / ranks


def _memory_terms(p: ModelPreset, world: int) -> tuple[float, float]:
    """(fixed bytes per device, bytes per local token) for training, see the module docstring."""
    if p.name not in PARAMETERS:
        raise ValueError(f"longest_context: no parameter count for {p.name!r}; known: {sorted(PARAMETERS)}")
    total, _ = PARAMETERS[p.name]
    fixed = 16.0 * total / world
    per_token = p.num_hidden_layers * p.hidden_size * 2 + 34 * p.hidden_size + 2 * _payload_per_token(p, 2.0)
    return fixed, per_token


def longest_context(p: ModelPreset, *, world: int, device: Device, memory_fraction: float = 0.9,
                    multiple: int = 1024) -> int:
    """Longest training context (a multiple of ``multiple`` tokens, and of 2W) that fits on ``world`` devices."""
    fixed, per_token = _memory_terms(p, world)
    room = memory_fraction * device.memory_bytes - fixed
    if room <= 0:
        return 0
    tokens = int(room / per_token) * world
    step = max(multiple, 2 * world)
    return tokens // step * step


@dataclass(frozen=True)
class PlanRow:
    world: int
    context: int
    layer: LayerTime | None
    step_s: float | None  # attention layers plus the per-token matmuls (6 * active params * tokens / W)


def plan(p: ModelPreset, *, device: Device = H200, scheme: str = "zigzag", max_world: int = 1024,
         memory_fraction: float = 0.9) -> list[PlanRow]:
    """For W = 1, 2, 4, ... ``max_world``: the longest context that fits and the training step time there."""
    rows, w = [], 1
    while w <= max_world:
        n = longest_context(p, world=w, device=device, memory_fraction=memory_fraction)
        if n == 0:
            rows.append(PlanRow(w, 0, None, None))
        else:
            lt = layer_time(p, context=n, world=w, scheme=scheme, device=device)
            _, active = PARAMETERS[p.name]
            step = p.num_hidden_layers * lt.total_s + 6 * active * n / w / device.matmul_flops_per_s
            rows.append(PlanRow(w, n, lt, step))
        w *= 2
    return rows
