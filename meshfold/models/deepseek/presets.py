"""Shipped shapes of the DeepSeek family (V2, V3, and Kimi K2: V3's architecture with 384
experts, one dense layer, 64 heads): multi-head latent attention, shared + fine-grained routed
experts, dense first layers."""

from __future__ import annotations

DEEPSEEK_YARN = dict(max_position=163840, rope_scaling="yarn", rope_factor=40.0, rope_original_seq_len=4096)

PRESETS: dict[str, dict] = {
    "deepseek-v2-lite": dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_dim=10944, vocab_size=102400, seq_len=4096,
                             norm_eps=1e-6, moe_experts=64, moe_topk=6, moe_ffn_dim=1408, moe_shared_experts=2,
                             moe_first_dense=1, moe_norm_topk=False, mla_kv_rank=512, **DEEPSEEK_YARN,
                             rope_attention_factor=1.0, rope_mscale_all_dim=0.707),
    "deepseek-v3": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432, vocab_size=129280, seq_len=4096,
                        norm_eps=1e-6, moe_experts=256, moe_topk=8, moe_ffn_dim=2048, moe_shared_experts=1,
                        moe_first_dense=3, moe_router="sigmoid", moe_bias_balance=True, moe_aux_loss_coef=0.0,
                        moe_groups=8, moe_topk_groups=4, moe_routed_scale=2.5, mla_kv_rank=512, mla_q_rank=1536,
                        **DEEPSEEK_YARN, rope_attention_factor=1.0, rope_mscale_all_dim=1.0),
    "kimi-k2": dict(dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, ffn_dim=18432, vocab_size=163840, seq_len=4096,
                    norm_eps=1e-6, rope_theta=50000.0, moe_experts=384, moe_topk=8, moe_ffn_dim=2048,
                    moe_shared_experts=1, moe_first_dense=1, moe_router="sigmoid", moe_bias_balance=True,
                    moe_aux_loss_coef=0.0, moe_routed_scale=2.827, mla_kv_rank=512, mla_q_rank=1536,
                    max_position=131072, rope_scaling="yarn", rope_factor=32.0, rope_original_seq_len=4096,
                    rope_beta_fast=1.0, rope_attention_factor=1.0, rope_mscale_all_dim=1.0),
}
