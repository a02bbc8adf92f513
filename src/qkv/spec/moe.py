"""The DeepSeekMoE feed-forward's shape and routing rule as data: Dai et al. 2024, "DeepSeekMoE: Towards Ultimate
Expert Specialization in Mixture-of-Experts Language Models" (arXiv:2401.06066). The module is :class:`qkv.nn.MoE`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoEConfig"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """DeepSeekMoE feed-forward (HF DeepSeek-V2 field names).

    Layer ``i`` is a mixture of experts when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``
    (DeepSeek's rule; HF transformers ignores ``moe_layer_freq``, which is 1 in every released checkpoint).
    Routing: softmax over ``n_routed_experts`` router logits (float32), top ``num_experts_per_tok`` by
    ``topk_method`` (``"greedy"``, or ``"group_limited_greedy"`` over ``n_group`` groups keeping
    ``topk_group``), weights renormalized when ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.
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

    def __post_init__(self) -> None:
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"MoEConfig: topk_method must be 'greedy' or 'group_limited_greedy', got "
                             f"{self.topk_method!r}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"MoEConfig: num_experts_per_tok ({self.num_experts_per_tok}) must lie in "
                             f"[1, n_routed_experts={self.n_routed_experts}]")
        if self.topk_method == "group_limited_greedy" and (
                not self.n_group or not self.topk_group or self.n_routed_experts % self.n_group):
            raise ValueError(f"MoEConfig: group_limited_greedy needs n_group dividing n_routed_experts "
                             f"({self.n_routed_experts}) and topk_group; got n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")

    def is_moe(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0
