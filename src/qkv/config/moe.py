"""The mixture-of-experts feed-forward's shape and routing rule as data: DeepSeekMoE (Dai et al. 2024,
arXiv:2401.06066), DeepSeek-V3's auxiliary-loss-free routing (arXiv:2412.19437), Qwen3-MoE, Qwen3-Next and GPT-OSS.
The module and the routing functions are in :mod:`qkv.nn.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEConfig"]

_TOPK_METHODS = ("greedy", "group_limited_greedy", "group_limited_top2", "noaux_tc", "topk_softmax",
                 "sqrtsoftplus")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (HF DeepSeek field names).

    Layer ``i`` is a mixture of experts when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``
    (DeepSeek's rule; HF transformers ignores ``moe_layer_freq``, which is 1 in every released checkpoint), or,
    when ``moe_layers`` is given, when ``i`` is in it (HF's ``mlp_layer_types`` ``"sparse"`` entries, MiniMax-M3).
    Routing (module notes): ``topk_method`` ``"greedy"``, ``"group_limited_greedy"`` (groups ranked by their best
    score) or ``"group_limited_top2"`` (by the sum of their two best scores, Mistral 4) (softmax scores,
    :func:`route_softmax`), ``"noaux_tc"`` (sigmoid scores with a correction bias, :func:`route_noaux_tc`)
    or ``"topk_softmax"`` (softmax over the selected logits, :func:`route_topk_softmax`); weights
    renormalized when ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.

    DeepSeek-V4: ``topk_method="sqrtsoftplus"`` (scores ``sqrt(softplus(logits))``, experts chosen by score plus
    ``e_score_correction_bias``, weighted by their unbiased scores, :func:`route_sqrt_softplus`); the layers in
    ``hash_layers`` choose their experts by a fixed table of the token id instead (``tid2eid``, :func:`route_hash`);
    ``silu_limit``: routed and shared experts clamp ``gate <= limit`` and ``|up| <= limit`` before
    ``silu(gate) * up``.

    GPT-OSS: ``router_bias`` (the router has a bias) and ``swiglu_limit`` (experts are
    :class:`ClampedSwiGLUExperts` with ``swiglu_alpha``, biases included; None: :class:`Experts`).

    Qwen3-Next (Qwen2-MoE's block): one shared expert of ``shared_expert_intermediate_size`` (default
    ``moe_intermediate_size * n_shared_experts``) whose output is scaled by ``sigmoid(shared_expert_gate(x))``, a
    learned scalar per token (``shared_expert_gate``).

    MiniMax-M3: ``swiglu_limit`` with a shared expert makes the shared expert GPT-OSS's clamped SwiGLU too
    (:class:`qkv.nn.moe.ClampedSwiGLUMLP`, no biases).

    Gemma 4 26B-A4B: ``beside_dense`` runs the experts beside the layer's dense MLP (its width
    ``intermediate_size_for(i)``) instead of replacing it; the router reads the residual stream before the layer's
    pre-norm and each expert's weight is times a learned per-expert scale (:class:`qkv.nn.parallel_moe.ParallelMoE`).
    It routes by softmax and top-k (``topk_method="greedy"``) and has no shared experts: the dense MLP is that path.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    router_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    hash_layers: tuple[int, ...] = ()
    silu_limit: float | None = None
    moe_layers: tuple[int, ...] | None = None
    beside_dense: bool = False

    def __post_init__(self) -> None:
        if self.moe_layers is not None:
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
            if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.moe_layers):
                raise ValueError(f"MoEConfig: moe_layers must be layer indices (ints >= 0) or None, got "
                                 f"{self.moe_layers!r}")
        if self.topk_method not in _TOPK_METHODS:
            raise ValueError(f"MoEConfig: topk_method must be one of {_TOPK_METHODS}, got {self.topk_method!r}")
        if self.topk_method == "noaux_tc" and self.n_group and self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"MoEConfig: noaux_tc scores each group by its two best experts; n_group={self.n_group} "
                             f"leaves {self.n_routed_experts // self.n_group} per group (use n_group <= "
                             f"{self.n_routed_experts // 2})")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"MoEConfig: swiglu_limit must be > 0 or None, got {self.swiglu_limit!r}")
        object.__setattr__(self, "hash_layers", tuple(self.hash_layers))
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.hash_layers):
            raise ValueError(f"MoEConfig: hash_layers must be layer indices (ints >= 0), got {self.hash_layers!r}")
        if self.hash_layers and self.topk_method != "sqrtsoftplus":
            raise ValueError(f"MoEConfig: hash_layers (DeepSeek-V4's hash routing) weigh their experts by "
                             f"sqrt-softplus scores; set topk_method='sqrtsoftplus', got {self.topk_method!r}")
        if self.silu_limit is not None and (self.swiglu_limit is not None or not self.silu_limit > 0):
            raise ValueError(f"MoEConfig: silu_limit must be > 0 or None, and not set with swiglu_limit (GPT-OSS's "
                             f"experts); got silu_limit={self.silu_limit!r}, swiglu_limit={self.swiglu_limit!r}")
        if self.beside_dense and (self.topk_method != "greedy" or self.n_shared_experts or self.hash_layers
                                  or self.swiglu_limit is not None or self.silu_limit is not None or self.router_bias):
            raise ValueError(f"MoEConfig: beside_dense (Gemma 4's experts beside the dense MLP) routes by softmax "
                             f"top-k over plain gated experts with no shared expert; got topk_method="
                             f"{self.topk_method!r}, n_shared_experts={self.n_shared_experts}, hash_layers="
                             f"{self.hash_layers!r}, swiglu_limit={self.swiglu_limit!r}, silu_limit="
                             f"{self.silu_limit!r}, router_bias={self.router_bias!r}")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ValueError("MoEConfig: shared_expert_gate needs a shared expert (n_shared_experts >= 1)")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"MoEConfig: num_experts_per_tok ({self.num_experts_per_tok}) must lie in "
                             f"[1, n_routed_experts={self.n_routed_experts}]")
        if self.topk_method == "group_limited_top2" and self.n_group and self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"MoEConfig: group_limited_top2 scores each group by its two best experts; n_group="
                             f"{self.n_group} leaves {self.n_routed_experts // self.n_group} per group (use n_group <= "
                             f"{self.n_routed_experts // 2})")
        if self.topk_method in ("group_limited_greedy", "group_limited_top2", "noaux_tc") and (
                not self.n_group or not self.topk_group or self.n_routed_experts % self.n_group):
            raise ValueError(f"MoEConfig: {self.topk_method} needs n_group dividing n_routed_experts "
                             f"({self.n_routed_experts}) and topk_group; got n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")

    @property
    def shared_width(self) -> int:
        """Hidden width of the shared experts, all together (0: none)."""
        if not self.n_shared_experts:
            return 0
        return self.shared_expert_intermediate_size or self.moe_intermediate_size * self.n_shared_experts

    def is_moe(self, layer_idx: int) -> bool:
        if self.moe_layers is not None:
            return layer_idx in self.moe_layers
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

