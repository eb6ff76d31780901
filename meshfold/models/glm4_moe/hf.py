"""Hugging Face adapter of GLM-4.5 (``glm4_moe`` <-> Glm4MoeForCausalLM).

Attention is Llama's with ``partial_rotary_factor`` (transformers' default 0.5: RoPE turns the
leading half of each head, ``model.rope_fraction``, in the half-split layout the shared driver
permutes), biases on q/k/v only (``attention_bias`` -> ``qkv_bias``) and ``use_qk_norm`` (->
``qk_norm``). The MoE layers route as DeepSeek-V3 (sigmoid scores, correction bias, groups, k
gates renormalised, ``routed_scaling_factor``) with ``n_shared_experts`` shared experts; the
first ``first_k_dense_replace`` layers are dense. Its multi-token prediction layer (decoder
layer ``num_hidden_layers`` in published checkpoints; transformers skips it) is stored as
DeepSeek-V3's: the DeepSeek adapter's MTP mapping serves it.
"""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.models import registry
from meshfold.models.deepseek.hf import DeepSeekAdapter
from meshfold.models.hf_adapter import HFAdapter, check_keys, refuse_sliding_window, rope_parameters

ARCHITECTURES = {"glm4_moe": "Glm4MoeForCausalLM"}


class Glm4MoeAdapter(DeepSeekAdapter):
    architectures = ARCHITECTURES
    layer_names: dict[str, str] = {}
    partial_rope = True
    rotated_heads = HFAdapter.rotated_heads  # grouped-query q/k in the half-split layout

    def natural_type(self, m) -> str | None:
        if m.attention != "gqa" or not m.moe_experts or m.moe_router != "sigmoid":
            return None
        return "glm4_moe"

    def config_keys(self, hf: dict, model_type: str) -> dict:
        refuse_sliding_window(hf)
        if hf.get("mlp_bias", False):
            raise ConfigError("convert: glm4_moe with mlp_bias = true is not supported")
        if not hf.get("norm_topk_prob", True):
            raise ConfigError("convert: glm4_moe with norm_topk_prob = false is not supported (meshfold's sigmoid "
                              "router always renormalises the k gates)")
        if not hf.get("n_shared_experts", 1):
            raise ConfigError("convert: glm4_moe with n_shared_experts = 0 is not supported")
        groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
        fraction = rope_parameters(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        return dict(qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm", False)),
                    rope_fraction=float(fraction), moe_experts=hf["n_routed_experts"],
                    moe_topk=hf["num_experts_per_tok"], moe_ffn_dim=hf["moe_intermediate_size"],
                    moe_shared_experts=hf.get("n_shared_experts", 1), moe_first_dense=hf.get("first_k_dense_replace", 1),
                    moe_routed_scale=float(hf.get("routed_scaling_factor", 1.0)), moe_router="sigmoid",
                    moe_bias_balance=True, moe_aux_loss_coef=0.0, moe_groups=groups if groups > 1 else 0,
                    moe_topk_groups=topk_groups if groups > 1 else 0)

    def export_type(self, m, arch: str | None) -> str:
        family = arch or self.natural_type(m)
        if family != "glm4_moe":
            raise ConfigError(f"convert export: this model exports as Glm4MoeForCausalLM, not "
                              f"{registry.hf_model_types().get(family, family)}")
        check_keys(m, dict(bias=False, moe_capacity_factor=0.0, moe_every=1, moe_dense_layers=[],
                           moe_bias_balance=True), ARCHITECTURES[family])
        if not m.moe_shared_experts:
            raise ConfigError("convert export: Glm4MoeForCausalLM needs model.moe_shared_experts > 0")
        return family

    def write_config(self, m, model_type: str, out: dict) -> None:
        out.update(n_routed_experts=m.moe_experts, num_experts_per_tok=m.moe_topk, moe_intermediate_size=m.expert_dim,
                   n_shared_experts=m.moe_shared_experts, first_k_dense_replace=m.moe_first_dense,
                   n_group=m.moe_groups or 1, topk_group=m.moe_topk_groups or 1,
                   routed_scaling_factor=m.moe_routed_scale, norm_topk_prob=True, attention_bias=m.qkv_bias,
                   use_qk_norm=m.qk_norm, num_nextn_predict_layers=m.mtp_depth,
                   partial_rotary_factor=m.rope_fraction)  # (written always: transformers' default is 0.5)


ADAPTER = Glm4MoeAdapter()
