"""Hugging Face adapter of the dense family: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3."""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.models import registry
from meshfold.models.hf_adapter import HFAdapter, check_keys, refuse_sliding_window

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# [model] keys each type cannot represent (a forced --arch must fit them).
NEED = {"llama": dict(qk_norm=False, qkv_bias=False), "mistral": dict(qk_norm=False, qkv_bias=False, bias=False),
        "qwen2": dict(qk_norm=False, bias=False), "qwen3": dict(qkv_bias=False, bias=False)}


class DenseAdapter(HFAdapter):
    architectures = ARCHITECTURES

    def natural_type(self, m) -> str | None:
        if m.moe_experts or m.attention != "gqa":
            return None
        return "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"

    def config_keys(self, hf: dict, model_type: str) -> dict:
        qwen = model_type in ("qwen2", "qwen3")
        refuse_sliding_window(hf, switched=qwen)
        attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if model_type == "qwen3" and attn_bias:
            raise ConfigError("convert: Qwen3 with attention_bias = true (biases on q/k/v/o without MLP biases) "
                              "is not supported")
        if not qwen and attn_bias != mlp_bias:
            raise ConfigError("convert: attention_bias and mlp_bias differ; meshfold has one model.bias switch "
                              "for both (and model.qkv_bias for q/k/v only)")
        return dict(bias=attn_bias and not qwen, qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")

    def export_type(self, m, arch: str | None) -> str:
        family = arch or self.natural_type(m)
        if family not in ARCHITECTURES:
            raise ConfigError(f"convert export: {registry.hf_model_types().get(arch, arch)} needs a MoE model (model.moe_experts > 0)")
        check_keys(m, NEED[family], ARCHITECTURES[family], "; choose another --arch")
        if family == "qwen2" and not m.qkv_bias:
            raise ConfigError("convert export: Qwen2ForCausalLM always has q/k/v biases; set --arch llama")
        return family

    def write_config(self, m, model_type: str, out: dict) -> None:
        if model_type in ("llama", "mistral"):
            out.update(attention_bias=m.bias, mlp_bias=m.bias)
        if model_type == "mistral":
            out["sliding_window"] = None
        if model_type in ("qwen2", "qwen3"):
            out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
        if model_type == "qwen3":
            out["attention_bias"] = False


ADAPTER = DenseAdapter()
