"""Shipped shapes of the mixture-of-experts family: Mixtral, Qwen3-MoE, DeepSeek-MoE (v1)."""

from __future__ import annotations

from meshfold.models.dense.presets import QWEN3

PRESETS: dict[str, dict] = {
    # Hugging Face MoE families (docs/hf.md, docs/moe.md); counts equal transformers' models.
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                         seq_len=4096, max_position=32768, rope_theta=1e6, moe_experts=8, moe_topk=2,
                         moe_aux_loss_coef=0.02),
    "mixtral-8x22b": dict(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384, vocab_size=32768,
                          seq_len=4096, max_position=65536, rope_theta=1e6, moe_experts=8, moe_topk=2,
                          moe_aux_loss_coef=0.02),
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, moe_ffn_dim=768,
                          moe_experts=128, moe_topk=8, moe_aux_loss_coef=0.001, **QWEN3),
    "qwen3-235b-a22b": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288, moe_ffn_dim=1536,
                            moe_experts=128, moe_topk=8, moe_aux_loss_coef=0.001, **QWEN3),
    # DeepSeek-MoE-16B-like fine-grained experts: 64 routed (top-6) + 2 shared, small expert width.
    "deepseek-moe-16b": dict(dim=2048, n_layers=28, n_heads=16, ffn_dim=10944, vocab_size=102400,
                             seq_len=4096, moe_experts=64, moe_topk=6, moe_ffn_dim=1408,
                             moe_shared_experts=2, moe_first_dense=1, moe_norm_topk=False),
    "moe-debug": dict(dim=64, n_layers=2, n_heads=4, vocab_size=512, seq_len=64, moe_experts=4, moe_topk=2),
}
