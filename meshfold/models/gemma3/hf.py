"""Hugging Face adapter of Gemma 3's text decoder (``gemma3_text``, ``Gemma3ForCausalLM``).

What differs from the Llama-style names: four norms per block (``input_layernorm``,
``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``
are meshfold's ``attention_norm``, ``post_attention_norm``, ``ffn_norm``, ``post_ffn_norm``),
``hidden_activation`` for ``hidden_act``, and RoPE per layer type (transformers 5's
``rope_parameters = {"full_attention": ..., "sliding_attention": ...}``; transformers 4's
``rope_theta`` + ``rope_scaling`` + ``rope_local_base_freq``). ``layer_types`` must follow
one ``sliding_window_pattern`` (every n-th layer global). q/k rows and the q/k norm weights
take the shared RoPE permutation.
"""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.models.hf_adapter import HFAdapter, check_keys, rope_parameters

ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}
ACTIVATION = "gelu_pytorch_tanh"


def layer_types(n_layers: int, window: int, pattern: int) -> list[str]:
    return ["sliding_attention" if window and (i + 1) % pattern else "full_attention" for i in range(n_layers)]


def _pattern(types: list[str]) -> int:
    """The n of "every n-th layer global" that ``types`` follow, or ConfigError."""
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    pattern = full[0] + 1 if full else len(types) + 1
    if types != layer_types(len(types), 1, pattern):
        raise ConfigError(f"convert: gemma3_text layer_types {types} do not repeat one sliding/global pattern")
    return pattern


def _whole(x: float) -> int | float:
    """An int where it is one (transformers' strict config types query_pre_attn_scalar as int)."""
    return int(x) if float(x).is_integer() else x


class Gemma3Adapter(HFAdapter):
    architectures = ARCHITECTURES
    norm, mlp = "gemma_rmsnorm", "geglu"
    layer_names = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                   "post_attention_norm.weight": "post_attention_layernorm.weight",
                   "post_ffn_norm.weight": "post_feedforward_layernorm.weight"}

    def natural_type(self, m) -> str | None:
        return "gemma3_text" if m.sandwich_norm and m.embed_scale and m.attention == "gqa" else None

    def rope_parameters(self, hf: dict) -> dict:
        """The global (full-attention) layers' RoPE: the model-wide keys."""
        per_type = hf.get("rope_parameters") or {}
        if "full_attention" in per_type:
            return dict(per_type["full_attention"])
        return rope_parameters(hf)

    def config_keys(self, hf: dict, model_type: str) -> dict:
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATION
        if activation != ACTIVATION:
            raise ConfigError(f"convert: gemma3_text hidden_activation {activation!r}; meshfold's GeGLU is "
                              f"{ACTIVATION}")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise ConfigError(f"convert: gemma3_text with {key} = {hf[key]} is not supported")
        if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
            raise ConfigError("convert: gemma3_text with attention_bias or use_bidirectional_attention is not supported")
        n, window = hf["num_hidden_layers"], hf.get("sliding_window") or 0
        types = hf.get("layer_types") or layer_types(n, window, hf.get("sliding_window_pattern", 6))
        pattern = _pattern(list(types))
        local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"convert: gemma3_text sliding layers with rope_type {local['rope_type']!r} are not "
                              f"supported")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        return dict(norm=self.norm, mlp=self.mlp, qk_norm=True, sandwich_norm=True, embed_scale=True,
                    sliding_window=window, sliding_pattern=pattern,
                    rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
                    query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim))

    def export_type(self, m, arch: str | None) -> str:
        if arch not in (None, "gemma3_text"):
            raise ConfigError(f"convert export: this model exports as Gemma3ForCausalLM, not {arch}")
        check_keys(m, dict(bias=False, qkv_bias=False, qk_norm=True, moe_experts=0), "Gemma3ForCausalLM")
        return "gemma3_text"

    def write_config(self, m, model_type: str, out: dict) -> None:
        out.pop("hidden_act")
        full = dict(out.pop("rope_scaling") or {"rope_type": "default"}, rope_theta=out.pop("rope_theta"))
        out.update(hidden_activation=ACTIVATION, attention_bias=False, use_bidirectional_attention=False,
                   rope_parameters={"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": m.rope_local_theta}},
                   sliding_window=m.sliding_window or None, sliding_window_pattern=m.sliding_pattern,
                   layer_types=layer_types(m.n_layers, m.sliding_window, m.sliding_pattern),
                   query_pre_attn_scalar=_whole(m.query_pre_attn_scalar or m.head_dim),
                   final_logit_softcapping=None, attn_logit_softcapping=None)


ADAPTER = Gemma3Adapter()
