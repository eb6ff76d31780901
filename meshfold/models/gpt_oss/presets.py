"""Shipped shapes of gpt-oss (openai/gpt-oss-20b and -120b, their ``config.json``): 64 heads of
64 over 8 kv heads on a 2,880-wide residual stream, 128-token windows on every other layer,
sinks, top-4 of 32 (128) experts of width 2,880, YaRN RoPE (factor 32 over 4,096 positions,
not truncated). Parameter counts equal transformers' ``GptOssForCausalLM`` on the same config
(tests/test_gpt_oss.py)."""

from __future__ import annotations

GPT_OSS = dict(dim=2880, n_heads=64, n_kv_heads=8, attn_head_dim=64, ffn_dim=2880, vocab_size=201088, seq_len=4096,
               max_position=131072, norm_eps=1e-5, rope_theta=150000.0, rope_scaling="yarn", rope_factor=32.0,
               rope_original_seq_len=4096, rope_truncate=False, bias=True, alternating_window=128,
               attention_sinks=True, mlp="clamped_swiglu", moe_topk=4, moe_bias=True, moe_norm_topk=True,
               moe_aux_loss_coef=0.001)

PRESETS: dict[str, dict] = {
    "gpt-oss-20b": dict(GPT_OSS, n_layers=24, moe_experts=32),
    "gpt-oss-120b": dict(GPT_OSS, n_layers=36, moe_experts=128),
}
