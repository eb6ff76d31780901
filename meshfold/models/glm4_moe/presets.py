"""Shipped shapes of GLM-4.5 (zai-org/GLM-4.5, GLM-4.5-Air config.json): 96 heads of 128 over
8 kv heads, half of each head turned by RoPE, q/k/v biases, 160 (128) routed experts + 1 shared,
top 8, dense first layers. Counts are transformers' (without the MTP layer it does not build)."""

from __future__ import annotations

GLM45 = dict(n_heads=96, n_kv_heads=8, attn_head_dim=128, vocab_size=151552, seq_len=4096, max_position=131072,
             norm_eps=1e-5, rope_theta=1e6, rope_fraction=0.5, qkv_bias=True, moe_topk=8, moe_shared_experts=1,
             moe_router="sigmoid", moe_bias_balance=True, moe_aux_loss_coef=0.0)

PRESETS: dict[str, dict] = {
    "glm-4.5": dict(GLM45, dim=5120, n_layers=92, ffn_dim=12288, qk_norm=True, moe_experts=160, moe_ffn_dim=1536,
                    moe_first_dense=3, moe_routed_scale=2.5),
    "glm-4.5-air": dict(GLM45, dim=4096, n_layers=46, ffn_dim=10944, moe_experts=128, moe_ffn_dim=1408,
                        moe_first_dense=1, moe_routed_scale=1.0),
}
