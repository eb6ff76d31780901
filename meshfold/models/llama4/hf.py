"""Hugging Face adapter of Llama 4's text decoder (``llama4_text``, ``Llama4ForCausalLM``).

What differs from the Llama-style names and values: the feed-forward is ``feed_forward``
(dense layers' ``gate_proj``/``up_proj``/``down_proj``; MoE layers' ``router``,
``shared_expert`` and the experts as two stacked tensors, ``gate_up_proj`` [E, dim, 2 F]
and ``down_proj`` [E, F, dim], the transposes of meshfold's ``w13`` and ``w2``); RoPE turns
interleaved pairs (``freqs_cis``, meshfold's own layout: q/k rows are not permuted); the
layer pattern (``no_rope_layers``, ``layer_types``, ``moe_layers``) must follow one interval
each, as transformers' defaults build them; top-1 routing only (the sigmoid gate scales the
token before its expert). ``intermediate_size`` is an expert's width, ``intermediate_size_mlp``
the dense layers'.
"""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.models.hf_adapter import HFAdapter, check_keys

ARCHITECTURES = {"llama4_text": "Llama4ForCausalLM"}
EXPERTS = "feed_forward.experts."


def nope_pattern(n_layers: int, interval: int) -> list[int]:
    """transformers' ``no_rope_layers`` (1 = RoPE) for a NoPE layer every ``interval`` (0 = none)."""
    return [int(not interval or (i + 1) % interval != 0) for i in range(n_layers)]


def _interval(no_rope: list[int]) -> int:
    """The NoPE interval ``no_rope`` follows, or ConfigError."""
    nope = [i for i, r in enumerate(no_rope) if not r]
    interval = nope[0] + 1 if nope else 0
    if list(no_rope) != nope_pattern(len(no_rope), interval):
        raise ConfigError(f"convert: llama4_text no_rope_layers {list(no_rope)} do not follow one interval")
    return interval


def layer_types(n_layers: int, interval: int, chunk: int) -> list[str]:
    return ["chunked_attention" if rope and chunk else "full_attention" for rope in nope_pattern(n_layers, interval)]


class Llama4Adapter(HFAdapter):
    architectures = ARCHITECTURES
    layer_names = {"feed_forward.w1.weight": "feed_forward.gate_proj.weight",
                   "feed_forward.w3.weight": "feed_forward.up_proj.weight",
                   "feed_forward.w2.weight": "feed_forward.down_proj.weight",
                   "feed_forward.router.weight": "feed_forward.router.weight",
                   "feed_forward.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
                   "feed_forward.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
                   "feed_forward.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight"}

    def natural_type(self, m) -> str | None:
        claims = m.moe_gate_input or m.attention_chunk_size or m.nope_interval or m.l2_qk_norm
        return "llama4_text" if claims and m.attention == "gqa" else None

    def config_keys(self, hf: dict, model_type: str) -> dict:
        if hf.get("attention_bias"):
            raise ConfigError("convert: llama4_text with attention_bias = true is not supported")
        if hf.get("num_experts_per_tok", 1) != 1:
            raise ConfigError(f"convert: llama4_text with num_experts_per_tok = {hf['num_experts_per_tok']} is not "
                              f"supported (meshfold scales one expert's input by its gate: top-1)")
        n, step = hf["num_hidden_layers"], hf.get("interleave_moe_layer_step", 1)
        if hf.get("moe_layers") is not None and list(hf["moe_layers"]) != list(range(step - 1, n, step)):
            raise ConfigError(f"convert: llama4_text moe_layers {hf['moe_layers']} are not every "
                              f"interleave_moe_layer_step = {step}-th layer")
        interval = _interval(hf.get("no_rope_layers") or nope_pattern(n, hf.get("no_rope_layer_interval", 4)))
        chunk = hf.get("attention_chunk_size") or 0
        if hf.get("layer_types") and list(hf["layer_types"]) != layer_types(n, interval, chunk):
            raise ConfigError(f"convert: llama4_text layer_types {hf['layer_types']} are not chunked on the RoPE "
                              f"layers and full on the NoPE ones")
        return dict(ffn_dim=hf.get("intermediate_size_mlp", hf["intermediate_size"]),
                    moe_experts=hf["num_local_experts"], moe_topk=1, moe_ffn_dim=hf["intermediate_size"],
                    moe_every=step, moe_shared_experts=1, moe_router="sigmoid", moe_norm_topk=False,
                    moe_gate_input=True, moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                    attention_chunk_size=chunk, nope_interval=interval, l2_qk_norm=bool(hf.get("use_qk_norm", True)),
                    attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                    attn_floor_scale=float(hf.get("floor_scale", 8192)), attn_scale=float(hf.get("attn_scale", 0.1)))

    def export_type(self, m, arch: str | None) -> str:
        if arch not in (None, "llama4_text"):
            raise ConfigError(f"convert export: this model exports as Llama4ForCausalLM, not {arch}")
        check_keys(m, dict(bias=False, qkv_bias=False, qk_norm=False, moe_topk=1, moe_shared_experts=1,
                           moe_router="sigmoid", moe_norm_topk=False, moe_gate_input=True, moe_capacity_factor=0.0,
                           moe_groups=0, moe_routed_scale=1.0, moe_bias_balance=False, moe_first_dense=0,
                           moe_dense_layers=[]), "Llama4ForCausalLM")
        return "llama4_text"

    def write_config(self, m, model_type: str, out: dict) -> None:
        n = m.n_layers
        out.update(intermediate_size=m.expert_dim, intermediate_size_mlp=m.hidden_dim, num_local_experts=m.moe_experts,
                   num_experts_per_tok=1, interleave_moe_layer_step=m.moe_every,
                   moe_layers=list(range(m.moe_every - 1, n, m.moe_every)),
                   no_rope_layers=nope_pattern(n, m.nope_interval), no_rope_layer_interval=m.nope_interval or 4,
                   attention_chunk_size=m.attention_chunk_size or None,
                   layer_types=layer_types(n, m.nope_interval, m.attention_chunk_size), use_qk_norm=m.l2_qk_norm,
                   attn_temperature_tuning=m.attn_temperature_tuning, floor_scale=int(m.attn_floor_scale),
                   attn_scale=m.attn_scale, attention_bias=False, router_aux_loss_coef=m.moe_aux_loss_coef)

    def rotated_heads(self, mine: str, m) -> int | None:
        return None  # interleaved pairs: meshfold's layout

    def own_from_hf(self, name: str, layer: int, rest: str, value, state: dict, m) -> dict | None:
        if rest in (EXPERTS + "gate_up_proj", EXPERTS + "down_proj"):
            mine = "w13" if rest.endswith("gate_up_proj") else "w2"
            return {f"{self.block_prefix(layer, m)}{EXPERTS}{mine}": value.transpose(1, 2)}
        return None

    def own_to_hf(self, name: str, value, m) -> dict | None:
        stem, _, leaf = name.rpartition(EXPERTS)
        if not stem:
            return None
        if leaf in ("w1", "w3"):
            return {}  # (both halves leave as one gate_up_proj: extra_to_hf)
        return {f"model.{stem}{EXPERTS}down_proj": value.transpose(1, 2)}

    def extra_to_hf(self, state: dict, m) -> dict:
        return {f"model.{name[:-len('w13')]}gate_up_proj": value.transpose(1, 2)
                for name, value in state.items() if name.endswith(EXPERTS + "w13")}


ADAPTER = Llama4Adapter()
