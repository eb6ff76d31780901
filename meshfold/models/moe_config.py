"""The mixture-of-experts block's ``[model]`` keys and checks (``models/moe.py`` is the block).

MoE is a shared block type: the dense decoder turns into Mixtral, Qwen3-MoE or DeepSeek by
these keys, whatever the family. Torch-free (the planner reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshfold.errors import ConfigError


@dataclass
class MoEKeys:
    """Mixture of experts (0 experts = dense)."""

    moe_experts: int = 0
    moe_topk: int = 2
    moe_every: int = 1  # every k-th layer is MoE (1 = all)
    moe_ffn_dim: int = 0  # per-expert hidden size, 0 = ffn_dim
    moe_shared_experts: int = 0
    moe_router: str = "softmax"  # softmax | sigmoid
    moe_capacity_factor: float = 0.0  # 0 = dropless
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    moe_bias_balance: bool = False  # aux-loss-free balancing via router bias
    moe_bias_update_rate: float = 1e-3
    moe_norm_topk: bool = True  # renormalise the k gates to sum 1 (Mixtral, DeepSeek-V3; off: Llama 4's sigmoid gates)
    moe_gate_input: bool = False  # top-1: the gate scales the token before its expert, not the output (Llama 4)
    moe_first_dense: int = 0  # leading dense layers before the first MoE layer (DeepSeek-MoE: 1)
    moe_dense_layers: list[int] = field(default_factory=list)  # further dense layers (Qwen3-MoE mlp_only_layers)
    # Group-limited routing (DeepSeek-V2/V3): experts in moe_groups equal groups, a token picks
    # the moe_topk_groups best groups first, then its top-k experts inside them. 0 = off.
    moe_groups: int = 0
    moe_topk_groups: int = 0
    moe_routed_scale: float = 1.0  # routed experts' gates times this (routed_scaling_factor)
    moe_seq_aux_loss_coef: float = 0.0  # DeepSeek-V3 sequence-wise balance loss (per sequence)
    moe_bias: bool = False  # biases on the router and on each routed expert's two GEMMs (gpt-oss)

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.hidden_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.moe_experts > 0 and layer >= self.moe_first_dense and (layer + 1) % self.moe_every == 0
                and layer not in self.moe_dense_layers)


CHOICES: dict[str, tuple] = {"moe_router": ("softmax", "sigmoid")}


def check_moe(m) -> None:
    if not m.moe_experts:
        return
    if not 1 <= m.moe_topk <= m.moe_experts:
        raise ConfigError(
            f"model.moe_topk = {m.moe_topk} must be between 1 and model.moe_experts = {m.moe_experts}"
        )
    if m.moe_every < 1:
        raise ConfigError(f"model.moe_every must be >= 1, got {m.moe_every}")
    if m.moe_first_dense < 0 or m.moe_first_dense >= m.n_layers:
        raise ConfigError(f"model.moe_first_dense = {m.moe_first_dense} must be between 0 and "
                          f"model.n_layers - 1 = {m.n_layers - 1}")
    if m.moe_groups:
        if m.moe_experts % m.moe_groups:
            raise ConfigError(f"model.moe_groups = {m.moe_groups} must divide model.moe_experts = {m.moe_experts}")
        if not 1 <= m.moe_topk_groups <= m.moe_groups:
            raise ConfigError(f"model.moe_topk_groups = {m.moe_topk_groups} must be between 1 and "
                              f"model.moe_groups = {m.moe_groups}")
        if m.moe_topk > m.moe_topk_groups * (m.moe_experts // m.moe_groups):
            raise ConfigError(f"model.moe_topk = {m.moe_topk} exceeds the experts of model.moe_topk_groups = "
                              f"{m.moe_topk_groups} groups")
    if any(not 0 <= i < m.n_layers for i in m.moe_dense_layers):
        raise ConfigError(f"model.moe_dense_layers = {m.moe_dense_layers} must be layer indices below "
                          f"model.n_layers = {m.n_layers}")
    if m.moe_seq_aux_loss_coef < 0:
        raise ConfigError(f"model.moe_seq_aux_loss_coef must be >= 0, got {m.moe_seq_aux_loss_coef}")
    if m.moe_gate_input and m.moe_topk != 1:
        raise ConfigError(f"model.moe_gate_input needs model.moe_topk = 1 (one gate per token), got {m.moe_topk}")
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor must be >= 0 (0 = dropless), got {m.moe_capacity_factor}")
