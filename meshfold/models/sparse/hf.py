"""Hugging Face adapter of the mixture-of-experts family: Mixtral (``block_sparse_moe``, experts'
w1/w3/w2) and Qwen3-MoE (q/k norms, ``mlp_only_layers``)."""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.models import registry
from meshfold.models.hf_adapter import HFAdapter, check_keys, refuse_sliding_window

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class SparseAdapter(HFAdapter):
    architectures = ARCHITECTURES

    def natural_type(self, m) -> str | None:
        if not m.moe_experts or m.attention != "gqa" or m.moe_router != "softmax":
            return None  # (Mixtral's and Qwen3-MoE's routers are softmax ones)
        return "qwen3_moe" if m.qk_norm else "mixtral"

    def config_keys(self, hf: dict, model_type: str) -> dict:
        qwen = model_type == "qwen3_moe"
        refuse_sliding_window(hf, switched=qwen)
        if qwen and hf.get("attention_bias", False):
            raise ConfigError("convert: Qwen3 with attention_bias = true (biases on q/k/v/o without MLP biases) "
                              "is not supported")
        if model_type == "mixtral":
            return dict(moe_experts=hf["num_local_experts"], moe_topk=hf["num_experts_per_tok"], moe_norm_topk=True,
                        moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))
        experts = hf.get("num_experts", hf.get("num_local_experts", 0))
        if not experts:
            return dict(qk_norm=True)
        return dict(qk_norm=True, moe_experts=experts, moe_topk=hf["num_experts_per_tok"],
                    moe_ffn_dim=hf["moe_intermediate_size"], moe_every=hf.get("decoder_sparse_step", 1),
                    moe_dense_layers=list(hf.get("mlp_only_layers") or []),
                    moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
                    moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))

    def export_type(self, m, arch: str | None) -> str:
        natural = self.natural_type(m)
        family = arch or natural
        if family != natural:
            raise ConfigError(f"convert export: this model exports as {ARCHITECTURES[natural]}, not {registry.hf_model_types().get(family, family)}")
        need = dict(bias=False, qkv_bias=False, moe_capacity_factor=0.0, moe_shared_experts=0, moe_router="softmax",
                    moe_groups=0, moe_routed_scale=1.0, moe_bias_balance=False)
        if family == "mixtral":
            need.update(moe_first_dense=0, moe_dense_layers=[], moe_every=1, moe_norm_topk=True)
        check_keys(m, need, ARCHITECTURES[family])
        return family

    def write_config(self, m, model_type: str, out: dict) -> None:
        if model_type == "mixtral":
            out.update(num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_topk, sliding_window=None,
                       router_aux_loss_coef=m.moe_aux_loss_coef, intermediate_size=m.expert_dim)
        else:
            out.update(attention_bias=False, num_experts=m.moe_experts, num_experts_per_tok=m.moe_topk,
                       moe_intermediate_size=m.expert_dim, decoder_sparse_step=m.moe_every,
                       norm_topk_prob=m.moe_norm_topk,
                       mlp_only_layers=sorted(set(m.moe_dense_layers) | set(range(m.moe_first_dense))),
                       router_aux_loss_coef=m.moe_aux_loss_coef)

    def hf_layer_name(self, hf_name: str, m) -> str:
        if self.natural_type(m) == "mixtral" and hf_name.startswith("mlp.gate."):
            return hf_name.replace("mlp.", "block_sparse_moe.", 1)
        return hf_name

    def expert_name(self, j: int, kind: str, m) -> str:
        if self.natural_type(m) == "mixtral":
            return f"block_sparse_moe.experts.{j}.{MIXTRAL_EXPERT_NAMES[kind]}.weight"
        return super().expert_name(j, kind, m)


ADAPTER = SparseAdapter()
