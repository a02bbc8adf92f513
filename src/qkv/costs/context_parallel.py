"""Context parallelism arithmetic: a layer's time on W devices per scheme, and the longest context that fits.

Pure arithmetic (no torch). The model of one attention layer on W devices, for a sequence of N tokens, describes
qkv's own implementation (:mod:`qkv.distributed`) and says what it assumes:

- Compute: the busiest rank's work. Attention FLOPs are ``2 * B * Hq * N^2 * (Dqk + Dv)`` for the whole problem;
  the busiest rank computes a fraction of them that depends on the scheme's layout and on the device's kernel
  (:func:`scheme_work`): with ``Device.skips_masked_tiles`` (FlashAttention-style kernels skip masked tiles, so
  a causal diagonal block costs half) zigzag, stripe, all-gather and Ulysses give every rank ``1 / (2W)`` of the
  ``N^2`` square and a contiguous ring gives the last rank ``(2W - 1) / (2W^2)``; without it (qkv's CPU blocks:
  any block the mask leaves non-empty is computed in full) the fractions are counts of whole blocks. The
  forward is the larger of those FLOPs over the attention throughput and the HBM time (this rank's Q, K, V and
  output once); the backward costs ``Device.backward_multiplier`` times the forward's FLOP time (2.5 for
  FlashAttention-2's count). Each block the rank computes adds ``Device.block_overhead_s`` per pass (host work:
  the block's mask, the merge, kernel launches). When ranks share cores (``Device.compute_share`` below 1, as
  W processes on fewer CPU cores), a pass takes at least the mean rank's work over its share: balanced schemes
  slow down by the full factor, an unbalanced ring less (its idle ranks leave their cores to the busy one).
- Communication over links of ``link_bytes_per_s`` with a per-message ``latency_s``. A chunk of K/V is
  ``c = B * (N / W) * Hkv * (Dqk + Dv) * e`` bytes (MLA passes its latent, ``kv_lora_rank + qk_rope_head_dim``
  per token, and expands it locally).
  - ring / zigzag / stripe: W-1 forward steps, each overlapping one step's blocks with one chunk's transfer,
    so a step costs ``max(blocks, c / bw + latency)``; backward W-1 steps of K/V (overlapped the same way) and
    W of float32 dK/dV (2c), each after its step's blocks (not overlapped).
  - allgather: one all-gather ((W-1) c sent per rank) before compute, one float32 reduce-scatter after backward.
  - ulysses: all-to-alls of Q, K, V and the output, ``(W-1) / W`` of each local tensor sent; again in backward.
  - usp: Ulysses over U ranks (U = the largest power of two <= min(8, Hkv) dividing W) and a ring over W / U.
  - ``check=True`` adds qkv's pre-flight agreement on shapes and dtypes: two small all-gathers, ``2 (W-1)``
    latencies.

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

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

from ..config.presets import ModelPreset
from .flops import TRAINING_MULTIPLIER

__all__ = ["Device", "H200", "PARAMETERS", "SCHEMES", "LayerTime", "SchemeWork", "layer_time", "longest_context",
           "plan", "PlanRow", "scheme_work", "ulysses_degree"]

SCHEMES = ("ring", "zigzag", "stripe", "allgather", "ulysses", "usp")

_POSITIVE = ("hbm_bytes_per_s", "attention_flops_per_s", "matmul_flops_per_s", "link_bytes_per_s")
_NON_NEGATIVE = ("memory_bytes", "latency_s", "backward_multiplier", "block_overhead_s")


@dataclass(frozen=True)
class Device:
    """One accelerator: memory, HBM bandwidth, sustained attention and matmul throughput, the link to its peers,
    and what the implementation costs beyond FLOPs and bytes.

    Attributes:
        name: a label.
        memory_bytes: device memory (0 for a device that only times layers).
        hbm_bytes_per_s: memory bandwidth.
        attention_flops_per_s: sustained forward attention throughput inside one block, FLOP/s.
        matmul_flops_per_s: sustained GEMM throughput (the per-token matmuls of a training step).
        link_bytes_per_s: bandwidth to a peer, each way.
        latency_s: fixed cost of one message.
        backward_multiplier: a block's backward time over its forward's (2.5: FlashAttention-2's count, which
            recomputes the scores; qkv's CPU blocks recompute them too and measure their own ratio).
        block_overhead_s: fixed cost of one block in one pass (forward or backward) beyond its FLOPs: building
            the block's mask, merging the partial result, launching kernels, Python.
        compute_share: the fraction of its device that each rank's compute gets: 1 when every rank owns its
            device; about ``cores / (ranks * threads)`` when W processes share fewer CPU cores.
        skips_masked_tiles: the block kernel skips masked tiles inside a block (FlashAttention: a causal diagonal
            block costs half); False: every block the mask leaves non-empty is computed in full (qkv's
            distributed blocks on CPU score every pair of a block).
    """

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    attention_flops_per_s: float
    matmul_flops_per_s: float
    link_bytes_per_s: float
    latency_s: float
    backward_multiplier: float = TRAINING_MULTIPLIER - 1
    block_overhead_s: float = 0.0
    compute_share: float = 1.0
    skips_masked_tiles: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(value, str):
                    raise TypeError(f"Device: name must be a str, got {type(value).__name__}")
                continue
            if f.name == "skips_masked_tiles":
                if not isinstance(value, bool):
                    raise TypeError(f"Device: skips_masked_tiles must be a bool, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Device: {f.name} must be a number, got {type(value).__name__} {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"Device: {f.name} must be finite, got {value!r}")
            if f.name in _POSITIVE and value <= 0:
                raise ValueError(f"Device: {f.name} must be > 0, got {value!r}; give the measured rate")
            if f.name in _NON_NEGATIVE and value < 0:
                raise ValueError(f"Device: {f.name} must be >= 0, got {value!r}; a cost cannot be negative")
        if not 0 < self.compute_share <= 1:
            raise ValueError(f"Device: compute_share must be in (0, 1], got {self.compute_share!r}; it is the "
                             "fraction of the device each rank gets (1 when ranks do not share it)")


#: NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional (450 GB/s each way). Sustained
#: throughputs are assumptions: 50% (attention, FlashAttention-3's bf16 forward reaches ~75%) and 60% (GEMMs)
#: of the 989 TFLOP/s dense bf16 peak; FlashAttention-2's backward (2.5 x the forward); 10 us per block and pass
#: (a block kernel and a merge kernel launched from Python); one rank per GPU.
H200 = Device("h200", 141e9, 4.8e12, 0.5 * 989e12, 0.6 * 989e12, 450e9, 5e-6, block_overhead_s=10e-6)

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
    compute_s: float  # the slowest rank's attention compute (block overheads and shared cores included)
    comm_s: float  # transfer time, overlapped or not
    total_s: float  # with the overlap the scheme allows
    bytes_sent: float  # per rank, forward (and backward when training)


class SchemeWork(NamedTuple):
    """One pass of a scheme: the busiest rank scores ``fraction`` of the ``B * Hq * N^2`` (query, key, head)
    triples in ``blocks`` block calls; ``mean_fraction`` and ``mean_blocks`` are the averages over the ranks
    (what ranks that share cores share)."""

    fraction: float
    blocks: int
    mean_fraction: float
    mean_blocks: float


def scheme_work(scheme: str, world: int, *, causal: bool = True, skips_masked_tiles: bool = True,
                ulysses: int = 1) -> SchemeWork:
    """The work of one pass of qkv's ``scheme`` over ``world`` ranks (self-attention, N x N).

    Blocks follow :mod:`qkv.distributed`: ring and stripe compute one block of ``N/W`` queries by ``N/W`` keys
    per step; zigzag and all-gather one block per pair of their ``N/(2W)`` chunks (``2W+1`` non-empty under a
    causal mask, ``4W`` without); Ulysses one block per pair of the W sequence shards for ``Hq/W`` heads; usp
    a ring over ``R = W/U`` groups of ``U = ulysses`` ranks, for ``Hq/U`` heads. Under a causal mask the
    contiguous ring (and usp's ring) is unbalanced: ring rank ``i`` computes ``i + 1`` blocks.

    ``skips_masked_tiles``: the kernel skips masked tiles inside a block, so the fraction is that of allowed pairs;
    otherwise every non-empty block counts in full.

    Example:
        >>> scheme_work("ring", 4)                                  # the last rank: 7/32 of the square
        SchemeWork(fraction=0.21875, blocks=4, mean_fraction=0.125, mean_blocks=2.5)
        >>> scheme_work("zigzag", 4, skips_masked_tiles=False)      # 9 blocks of (N/8)^2 on every rank
        SchemeWork(fraction=0.140625, blocks=9, mean_fraction=0.140625, mean_blocks=9.0)
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme_work: unknown scheme {scheme!r}; choose one of {SCHEMES}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"scheme_work: world must be an int >= 1, got {world!r}")
    if isinstance(ulysses, bool) or not isinstance(ulysses, int) or ulysses < 1 or world % ulysses:
        raise ValueError(f"scheme_work: ulysses must be an int >= 1 that divides world={world}, got {ulysses!r}")
    W = world
    U = ulysses if scheme == "usp" else 1
    R = W // U
    blocks = {"ring": W, "stripe": W, "zigzag": 2 * W + 1 if causal else 4 * W, "usp": R,
              "ulysses": W * (W + 1) // 2 if causal else W * W}
    blocks["allgather"] = blocks["zigzag"]
    n_blocks = blocks[scheme]
    if not causal:
        return SchemeWork(1 / W, n_blocks, 1 / W, float(n_blocks))
    contiguous = scheme in ("ring", "usp")  # ring rank i computes i + 1 blocks of (N/R)^2 for Hq/U heads
    mean_blocks = (R + 1) / 2 if contiguous else float(n_blocks)
    if skips_masked_tiles:
        # the last ring rank: R-1 full blocks and half a diagonal one; in all, half the square
        fraction = (2 * R - 1) / (2 * R * R) / U if contiguous else 1 / (2 * W)
        return SchemeWork(fraction, n_blocks, 1 / (2 * W), mean_blocks)
    fraction = {"zigzag": (2 * W + 1) / (4 * W * W), "allgather": (2 * W + 1) / (4 * W * W),
                "ulysses": (W + 1) / (2 * W * W)}.get(scheme, 1 / W)
    mean = (R + 1) / (2 * R * R) / U if contiguous else fraction
    return SchemeWork(fraction, n_blocks, mean, mean_blocks)


def _dense_attention_only(p: ModelPreset, owner: str) -> None:
    """The arithmetic here models dense (masked) attention over the whole context: refuse a model that selects
    its keys (DeepSeek Sparse Attention), whose indexer keys also travel and whose attention reads K keys per
    query, rather than give it dense numbers."""
    if p.config.indexer is not None:
        raise ValueError(f"{owner}: {p.name!r} attends to index_topk={p.config.indexer.index_topk} selected keys per "
                         f"query (DeepSeek Sparse Attention); this context-parallel arithmetic models dense attention "
                         f"only (its K/V payload, N^2 work), so it would misstate this model; use the dense base "
                         f"model's preset for an upper bound, or qkv.costs.dsa for the sparse layer's work")


def _payload_per_token(p: ModelPreset, e: float) -> float:
    """Bytes of K and V (or MLA's latent) per token that travel between ranks."""
    lat = p.config.latent
    if lat is not None:
        return (lat.kv_lora_rank + lat.qk_rope_head_dim) * e
    return _kv_heads(p) * (p.key_head_dim + p.value_head_dim) * e


def _kv_heads(p: ModelPreset) -> int:
    """Key/value heads: one per query head for MLA (its latent expands to every head)."""
    c = p.config
    return c.num_attention_heads if c.latent is not None else c.num_key_value_heads


def ulysses_degree(p: ModelPreset, world: int) -> int:
    """Ulysses ranks of ``usp``: the largest power of two <= min(8, Hkv) that divides ``world``."""
    u = 1
    while u * 2 <= min(8, _kv_heads(p)) and world % (u * 2) == 0:
        u *= 2
    return u


def layer_time(p: ModelPreset, *, context: int, world: int, scheme: str, device: Device, batch: int = 1,
               causal: bool = True, training: bool = True, bytes_per_element: float = 2.0,
               accumulate_bytes: float = 4.0, check: bool = False, ulysses: int | None = None) -> LayerTime:
    """Predicted time of one attention layer of ``p`` over ``context`` tokens on ``world`` devices.

    ``bytes_per_element``: K/V on the wire (2 for bf16); ``accumulate_bytes``: the dK/dV accumulators (float32);
    ``check``: include qkv's pre-flight agreement (``qkv.distributed.attention(check=True)``, its default);
    ``ulysses``: the Ulysses degree U of ``usp`` (default :func:`ulysses_degree`).
    """
    _dense_attention_only(p, "layer_time")
    if scheme not in SCHEMES:
        raise ValueError(f"layer_time: unknown scheme {scheme!r}; choose one of {SCHEMES}")
    if world < 1 or context < world:
        raise ValueError(f"layer_time: need 1 <= world <= context, got world={world}, context={context}")
    if not isinstance(device, Device):
        raise TypeError(f"layer_time: device must be a qkv.costs.context_parallel.Device, got {type(device).__name__}")
    e, bw, lat, W = bytes_per_element, device.link_bytes_per_s, device.latency_s, world
    U = (ulysses_degree(p, W) if ulysses is None else ulysses) if scheme == "usp" else 1
    work = scheme_work(scheme, W, causal=causal, skips_masked_tiles=device.skips_masked_tiles, ulysses=U)
    Hq, width = p.config.num_attention_heads, p.key_head_dim + p.value_head_dim
    flops_all = 2.0 * batch * Hq * context ** 2 * width
    # A block is bound by its FLOPs or by reading its Q, K, V and writing its output from HBM.
    hbm = batch * (context / W) * (Hq + _kv_heads(p)) * width * e
    hbm_s = hbm / device.hbm_bytes_per_s
    core = max(flops_all * work.fraction / device.attention_flops_per_s, hbm_s)
    core_mean = max(flops_all * work.mean_fraction / device.attention_flops_per_s, hbm_s)
    ovh, share, bm = device.block_overhead_s, device.compute_share, device.backward_multiplier
    # The busiest rank's own work, or, where ranks share cores, every rank's work over the cores they share (a
    # rank that waits for its peer leaves its core to the others).
    fwd = max(core + work.blocks * ovh, (core_mean + work.mean_blocks * ovh) / share)
    bwd = max(bm * core + work.blocks * ovh, (bm * core_mean + work.mean_blocks * ovh) / share) if training else 0.0
    chunk = batch * (context / W) * _payload_per_token(p, e)
    local = batch * (context / W)
    if scheme in ("ring", "zigzag", "stripe", "usp"):
        R = W // U
        if p.config.latent is not None:
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
            # qkv's backward overlaps the K/V shift with the step's blocks, then shifts dK/dV (not overlapped)
            total += b_step + (steps - 1) * max(b_step, t_c) + steps * t_g
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
    if check and W > 1:
        comm += 2 * (W - 1) * lat
        total += 2 * (W - 1) * lat
    return LayerTime(scheme, W, fwd + bwd, comm, total, sent)


def _all_to_all(p: ModelPreset, local_tokens: float, ranks: int, e: float) -> float:
    """Bytes one rank sends in the four all-to-alls of Ulysses (Q, K, V, out) over ``ranks`` ranks."""
    per_token = (p.config.num_attention_heads + _kv_heads(p)) * (p.key_head_dim + p.value_head_dim) * e
    return local_tokens * per_token * (ranks - 1) / ranks


def _parameters(p: ModelPreset) -> tuple[float, float]:
    """(total, active) parameters: the model card's where :data:`PARAMETERS` has them, else counted from the
    preset's whole-model config (:func:`qkv.costs.num_parameters`, e.g. a preset read from a config.json)."""
    if p.name in PARAMETERS:
        return PARAMETERS[p.name]
    from .params import num_parameters

    try:
        count = num_parameters(p)
    except ValueError as e:
        raise ValueError(f"longest_context: no parameter count for {p.name!r} (known: {sorted(PARAMETERS)}), and "
                         f"none can be counted: {e}") from None
    return float(count.total), float(count.active)


def _memory_terms(p: ModelPreset, world: int) -> tuple[float, float]:
    """(fixed bytes per device, bytes per local token) for training, see the module docstring."""
    total, _ = _parameters(p)
    fixed = 16.0 * total / world
    c = p.config
    per_token = c.num_hidden_layers * c.hidden_size * 2 + 34 * c.hidden_size + 2 * _payload_per_token(p, 2.0)
    return fixed, per_token


def longest_context(p: ModelPreset, *, world: int, device: Device, memory_fraction: float = 0.9,
                    multiple: int = 1024) -> int:
    """Longest training context (a multiple of ``multiple`` tokens, and of 2W) that fits on ``world`` devices."""
    _dense_attention_only(p, "longest_context")
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
            _, active = _parameters(p)
            step = p.config.num_hidden_layers * lt.total_s + 6 * active * n / w / device.matmul_flops_per_s
            rows.append(PlanRow(w, n, lt, step))
        w *= 2
    return rows
