"""Hugging Face adapter of the DeepSeek family (``deepseek_v2``, ``deepseek_v3``, and Kimi K2's
``kimi_k2``: DeepSeek-V3's architecture and tensors under its own ``model_type``).

Multi-head latent attention rotates adjacent pairs like meshfold (``deepseek/mla.py``): its
weights need no permutation. The router's ``e_score_correction_bias`` (V3) is the balancing
bias ``expert_bias``; ``shared_experts`` are ``feed_forward.shared_experts`` (both in
``models/hf.py``'s maps). DeepSeek-V3's multi-token prediction module k (``deepseek/mtp.py``)
is stored as decoder layer n_layers + k with these tensors beside the block's (meshfold:
``mtp.{k}.`` + name; the block under ``mtp.{k}.block.``), and its own copies of the embedding
and output head, which meshfold shares.
"""

from __future__ import annotations

import dataclasses

from meshfold.errors import ConfigError
from meshfold.models import registry
from meshfold.models.hf_adapter import HFAdapter, check_keys, rope_parameters

ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "kimi_k2": "DeepseekV3ForCausalLM"}
ALIASES = {"kimi_k2": "deepseek_v3"}  # model_type -> the DeepSeek version whose architecture it is
MLA_NAMES = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
}
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "norm.weight": "shared_head.norm.weight"}
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}


def mtp_layers_in(names, m) -> int:
    """How many multi-token prediction modules (decoder layers past ``m.n_layers``, DeepSeek-V3)
    tensors ``names`` hold: 0 unless they are the consecutive layers n_layers, n_layers + 1, ..."""
    extra = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()
             and int(n.split(".")[2]) >= m.n_layers}
    depth = 0
    while m.n_layers + depth in extra:
        depth += 1
    return depth


def _moe_keys(hf: dict, model_type: str) -> dict:
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"convert: moe_layer_freq = {hf['moe_layer_freq']} is not supported (transformers "
                          f"makes every layer from first_k_dense_replace on a MoE layer)")
    scoring = hf.get("scoring_func", "softmax" if model_type == "deepseek_v2" else "sigmoid")
    if (model_type, scoring) not in (("deepseek_v2", "softmax"), ("deepseek_v3", "sigmoid")):
        raise ConfigError(f"convert: {model_type} with scoring_func = {scoring!r} is not supported")
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    out = dict(moe_experts=hf["n_routed_experts"], moe_topk=hf["num_experts_per_tok"],
               moe_ffn_dim=hf["moe_intermediate_size"], moe_shared_experts=hf.get("n_shared_experts") or 0,
               moe_first_dense=hf.get("first_k_dense_replace") or 0,
               moe_routed_scale=float(hf.get("routed_scaling_factor", 1.0)))
    if model_type == "deepseek_v2":  # transformers' V2 never renormalises the k gates
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"convert: deepseek_v2 topk_method {method!r} is not supported")
        limited = method == "group_limited_greedy" and groups > 1
        return dict(out, moe_norm_topk=False, moe_groups=groups if limited else 0,
                    moe_topk_groups=topk_groups if limited else 0)
    if not hf.get("norm_topk_prob", True):
        raise ConfigError("convert: deepseek_v3 with norm_topk_prob = false is not supported (meshfold's sigmoid "
                          "router always renormalises the k gates)")
    if hf.get("rope_interleave", True) is False:
        raise ConfigError("convert: deepseek_v3 with rope_interleave = false is not supported")
    # V3 balances without an auxiliary loss: the correction bias (moe_bias_balance) does.
    return dict(out, moe_router="sigmoid", moe_bias_balance=True, moe_aux_loss_coef=0.0,
                moe_groups=groups if groups > 1 else 0, moe_topk_groups=topk_groups if groups > 1 else 0)


class DeepSeekAdapter(HFAdapter):
    architectures = ARCHITECTURES
    layer_names = MLA_NAMES

    def natural_type(self, m) -> str | None:
        if m.attention != "mla":
            return None
        return "deepseek_v3" if m.moe_router == "sigmoid" else "deepseek_v2"

    def config_keys(self, hf: dict, model_type: str) -> dict:
        model_type = ALIASES.get(model_type, model_type)
        if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
            raise ConfigError("convert: DeepSeek with attention_bias or mlp_bias = true is not supported")
        keys = dict(attn_head_dim=0,  # DeepSeek's head_dim is the rope part
                    mla_kv_rank=hf["kv_lora_rank"], mla_q_rank=hf.get("q_lora_rank") or 0,
                    mla_rope_dim=hf["qk_rope_head_dim"], mla_nope_dim=hf["qk_nope_head_dim"],
                    mla_v_dim=hf["v_head_dim"], **_moe_keys(hf, model_type))
        rope = rope_parameters(hf)
        if rope.get("rope_type", rope.get("type", "default")) == "yarn":
            # MLA's softmax scale takes mscale(factor, mscale_all_dim)^2
            keys["rope_mscale_all_dim"] = float(rope.get("mscale_all_dim") or 0.0)
        return keys

    def export_type(self, m, arch: str | None) -> str:
        natural = self.natural_type(m)
        family = arch or natural
        if ALIASES.get(family, family) != natural:
            raise ConfigError(f"convert export: this model exports as {ARCHITECTURES[natural]}, not "
                              f"{registry.hf_model_types().get(family, family)}")
        if not m.moe_experts:
            raise ConfigError(f"convert export: {ARCHITECTURES[family]} needs model.moe_experts > 0")
        need = dict(bias=False, qkv_bias=False, moe_capacity_factor=0.0, moe_every=1, moe_dense_layers=[],
                    qk_norm=False, attn_head_dim=0)
        need.update(dict(moe_norm_topk=False, moe_bias_balance=False) if natural == "deepseek_v2"
                    else dict(moe_bias_balance=True))
        check_keys(m, need, ARCHITECTURES[family])
        return family

    def write_config(self, m, model_type: str, out: dict) -> None:
        model_type = ALIASES.get(model_type, model_type)
        out.update(n_routed_experts=m.moe_experts, num_experts_per_tok=m.moe_topk, moe_intermediate_size=m.expert_dim,
                   n_shared_experts=m.moe_shared_experts, first_k_dense_replace=m.moe_first_dense, moe_layer_freq=1,
                   n_group=m.moe_groups or 1, topk_group=m.moe_topk_groups or 1,
                   routed_scaling_factor=m.moe_routed_scale, norm_topk_prob=model_type == "deepseek_v3",
                   q_lora_rank=m.mla_q_rank or None, kv_lora_rank=m.mla_kv_rank, qk_rope_head_dim=m.mla_rope_dim,
                   qk_nope_head_dim=m.mla_nope_dim, v_head_dim=m.mla_v_dim, head_dim=m.mla_rope_dim,
                   attention_bias=False, mlp_bias=False, num_nextn_predict_layers=m.mtp_depth)
        if model_type == "deepseek_v2":
            out.update(topk_method="group_limited_greedy" if m.moe_groups else "greedy", scoring_func="softmax")
        else:
            out.update(topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True)
        if out["rope_scaling"] and m.rope_scaling == "yarn" and m.rope_mscale_all_dim:
            out["rope_scaling"]["mscale_all_dim"] = m.rope_mscale_all_dim

    def rotated_heads(self, mine: str, m) -> int | None:
        return None  # latent attention rotates adjacent pairs on both sides

    def split_name(self, name: str, m) -> tuple[int, str]:
        head, layer, rest = name.split(".", 2)
        if head == "mtp":  # depth k's block: HF decoder layer n_layers + k
            return m.n_layers + int(layer), rest.removeprefix("block.")
        return int(layer), rest

    def own_to_hf(self, name: str, value, m) -> dict | None:
        head, depth, rest = name.split(".", 2) if name.count(".") >= 2 else (name, "", "")
        if head != "mtp" or rest not in MTP_NAMES:
            return None
        return {f"model.layers.{m.n_layers + int(depth)}.{MTP_NAMES[rest]}": value}

    def extra_to_hf(self, state: dict, m) -> dict:
        out = {}
        for k in range(m.mtp_depth):  # the module's own copies of the shared embedding and head
            for hf_name, mine in MTP_COPIES.items():
                mine = "tok_embeddings.weight" if (m.tie_embeddings and mine == "output.weight") else mine
                out[f"model.layers.{m.n_layers + k}.{hf_name}"] = state[mine].clone()  # (safetensors: no shared storage)
        return out

    def own_from_hf(self, name: str, layer: int, rest: str, value, state: dict, m) -> dict | None:
        if layer < m.n_layers:
            return None
        depth = layer - m.n_layers
        if depth >= m.mtp_depth:
            return {}  # not imported (complete() sets mtp_depth from the layers the files hold)
        if rest in MTP_COPIES:  # meshfold shares the main model's: they must be equal
            main = state.get("model.embed_tokens.weight" if rest == "embed_tokens.weight" else "lm_head.weight")
            if main is not None and not main.equal(value):
                raise ConfigError(f"convert import: {name} differs from the main model's "
                                  f"{'embedding' if rest == 'embed_tokens.weight' else 'output head'}; "
                                  f"meshfold's multi-token prediction shares them")
            return {}
        mtp_names = {v: k for k, v in MTP_NAMES.items()}
        if rest in mtp_names:
            return {f"mtp.{depth}.{mtp_names[rest]}": value}
        return None

    def block_prefix(self, layer: int, m) -> str:
        return f"layers.{layer}." if layer < m.n_layers else f"mtp.{layer - m.n_layers}.block."

    def complete(self, m, names):
        """DeepSeek-V3's multi-token prediction modules, where the files hold them (transformers
        neither runs nor saves them: num_nextn_predict_layers alone imports none)."""
        return dataclasses.replace(m, mtp_depth=mtp_layers_in(names, m))


ADAPTER = DeepSeekAdapter()
