"""Hugging Face adapter of gpt-oss (``gpt_oss`` <-> GptOssForCausalLM).

Attention is Llama's with biases on q/k/v/o (``attention_bias`` -> ``bias``), a sink logit per
head (``self_attn.sinks`` <-> ``attention.sinks``) and ``layer_types`` alternating
``sliding_attention`` / ``full_attention`` from the first layer (``alternating_window``). The
router is ``mlp.router`` (weight and bias). The experts are stored fused and transposed,
[E, in, out], with gate and up *interleaved* along the output (gate in the even columns):
``mlp.experts.gate_up_proj`` [E, dim, 2 F] + ``gate_up_proj_bias`` [E, 2 F] and
``mlp.experts.down_proj`` [E, F, dim] + ``down_proj_bias``; meshfold's ``experts.w13`` is
[E, 2 F, dim], gate's rows then up's. Published checkpoints hold the expert weights in MXFP4
(``*_blocks`` uint8 [E, out, in / 32, 16], two e2m1 values a byte, low nibble first, and
``*_scales`` uint8 [E, out, in / 32], a power of two 2^(s - 127) per 32 values): they are
dequantised on import (exactly: every value is representable in bfloat16) and exported as
plain tensors in the checkpoint's dtype (``convert export --dtype bfloat16``), no
``quantization_config``.
"""

from __future__ import annotations

import re

import torch

from meshfold.errors import ConfigError
from meshfold.models.hf_adapter import HFAdapter, check_keys

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_blocks|_bias)?")


def layer_types(n_layers: int, window: int) -> list[str]:
    return ["sliding_attention" if window and (i + 1) % 2 else "full_attention" for i in range(n_layers)]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 [..., G, 16] uint8 blocks and [..., G] uint8 exponents -> [..., 32 G] values: byte j
    holds values 2j (low nibble) and 2j + 1 (high nibble), each times 2^(scale - 127)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    pairs = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(pairs, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def _deinterleave(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate/up interleaved along ``dim`` (gate first) -> gate's entries, then up's."""
    pairs = w.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def _interleave(w: torch.Tensor, dim: int) -> torch.Tensor:
    gate, up = w.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


class GptOssAdapter(HFAdapter):
    architectures = ARCHITECTURES
    mlp = "clamped_swiglu"
    layer_names = {"attention.sinks": "self_attn.sinks", "feed_forward.router.weight": "mlp.router.weight",
                   "feed_forward.router.bias": "mlp.router.bias",
                   "feed_forward.experts.w2_bias": "mlp.experts.down_proj_bias"}

    def natural_type(self, m) -> str | None:
        return "gpt_oss" if m.attention == "gqa" and m.moe_experts else None

    def config_keys(self, hf: dict, model_type: str) -> dict:
        n, window = hf["num_hidden_layers"], hf.get("sliding_window") or 0
        types = list(hf.get("layer_types") or layer_types(n, window))
        if not window and "sliding_attention" in types:
            raise ConfigError("convert: gpt_oss layer_types name sliding_attention layers but sliding_window is unset")
        if types not in (layer_types(n, window), layer_types(n, 0)):
            raise ConfigError(f"convert: gpt_oss layer_types {types[:4]}... do not alternate sliding/full from the "
                              f"first layer")
        quant = (hf.get("quantization_config") or {}).get("quant_method")
        if quant not in (None, "mxfp4"):
            raise ConfigError(f"convert: gpt_oss quantization {quant!r} is not supported (MXFP4 experts are)")
        return dict(bias=bool(hf.get("attention_bias", True)), attention_sinks=True,
                    alternating_window=window if "sliding_attention" in types else 0, mlp=self.mlp,
                    swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                    moe_experts=hf["num_local_experts"], moe_topk=hf["num_experts_per_tok"], moe_norm_topk=True,
                    moe_bias=True, moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))

    def export_type(self, m, arch: str | None) -> str:
        if arch not in (None, "gpt_oss"):
            raise ConfigError(f"convert export: this model exports as GptOssForCausalLM, not {arch}")
        check_keys(m, dict(qkv_bias=False, qk_norm=False, attention_sinks=True, moe_bias=True, moe_norm_topk=True,
                           moe_router="softmax", moe_shared_experts=0, moe_groups=0, moe_routed_scale=1.0,
                           moe_capacity_factor=0.0, moe_bias_balance=False, tie_embeddings=False),
                   "GptOssForCausalLM")
        return "gpt_oss"

    def write_config(self, m, model_type: str, out: dict) -> None:
        rope = dict(out.pop("rope_scaling") or {"rope_type": "default"}, rope_theta=out.pop("rope_theta"))
        out.update(rope_parameters=rope, attention_bias=m.bias, sliding_window=m.alternating_window or None,
                   layer_types=layer_types(m.n_layers, m.alternating_window), num_local_experts=m.moe_experts,
                   num_experts_per_tok=m.moe_topk, intermediate_size=m.expert_dim, swiglu_alpha=m.swiglu_alpha,
                   swiglu_limit=m.swiglu_limit, router_aux_loss_coef=m.moe_aux_loss_coef)

    def transformers_kwargs(self, hf: dict) -> dict:
        if (hf.get("quantization_config") or {}).get("quant_method") != "mxfp4":
            return {}
        import transformers  # (convert check's own dependency)

        return {"quantization_config": transformers.Mxfp4Config(dequantize=True)}

    def import_tensors(self, state: dict, m) -> dict:
        """The experts in meshfold's layout under their own names (``experts.w13``,
        ``w13_bias``, ``w2``): MXFP4 dequantised, [E, in, out] turned to [E, out, in],
        gate/up de-interleaved. The other tensors pass through."""
        out = {}
        dtype = next((v.dtype for k, v in state.items() if k.endswith("_proj_bias")), torch.bfloat16)
        for name, value in state.items():
            match = _EXPERTS.fullmatch(name)
            if match is None:
                if not (name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in state):
                    out[name] = value  # (an MXFP4 exponent goes with its blocks)
                continue
            stem, proj, kind = match.groups()
            if kind == "_blocks":  # MXFP4: [E, out, in] already
                value = dequantize_mxfp4(value, state[name.removesuffix("_blocks") + "_scales"], dtype)
            elif kind is None:
                value = value.transpose(1, 2)
            if proj == "gate_up_proj":
                value = _deinterleave(value, 1)
                out[stem + ("w13_bias" if kind == "_bias" else "w13")] = value
            else:
                out[stem + ("down_proj_bias" if kind == "_bias" else "w2")] = value
        return out

    def own_from_hf(self, name: str, layer: int, rest: str, value, state: dict, m) -> dict | None:
        leaf = rest.removeprefix("mlp.experts.")
        if leaf in ("w13", "w13_bias", "w2"):
            return {f"layers.{layer}.feed_forward.experts.{leaf}": value}
        return None

    def own_to_hf(self, name: str, value, m) -> dict | None:
        layer, _, rest = name.removeprefix("layers.").partition(".")
        prefix = f"model.layers.{layer}.mlp.experts."
        if rest in ("feed_forward.experts.w1", "feed_forward.experts.w3"):
            return {}  # written from the fused w13 (extra_to_hf)
        if rest == "feed_forward.experts.w2":
            return {prefix + "down_proj": value.transpose(1, 2)}
        if rest == "feed_forward.experts.w13_bias":
            return {prefix + "gate_up_proj_bias": _interleave(value, 1)}
        return None

    def extra_to_hf(self, state: dict, m) -> dict:
        return {f"model.{name.removesuffix('feed_forward.experts.w13')}mlp.experts.gate_up_proj":
                _interleave(value, 1).transpose(1, 2)
                for name, value in state.items() if name.endswith(".feed_forward.experts.w13")}


ADAPTER = GptOssAdapter()
