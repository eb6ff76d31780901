"""Shipped shapes of Llama 4's text decoders (meta-llama/Llama-4-Scout-17B-16E and
Llama-4-Maverick-17B-128E, ``text_config``): 48 layers of 40 heads of 128 over 8 kv heads,
chunked attention (8,192) on three of four layers, NoPE on every fourth with temperature
tuning, top-1 sigmoid experts with a shared one; Scout: 16 experts on every layer, the L2
q/k norm; Maverick: 128 experts on every second layer, no q/k norm. Counts are transformers'
for Llama4ForCausalLM on the same config (tests/test_llama4.py)."""

from __future__ import annotations

LLAMA4 = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=16384, moe_ffn_dim=8192, vocab_size=202048,
              seq_len=8192, norm_eps=1e-5, rope_theta=5e5, moe_topk=1, moe_shared_experts=1, moe_router="sigmoid",
              moe_norm_topk=False, moe_gate_input=True, moe_aux_loss_coef=0.001, attention_chunk_size=8192,
              nope_interval=4, attn_temperature_tuning=True, attn_floor_scale=8192.0, attn_scale=0.1)

PRESETS: dict[str, dict] = {
    "llama4-scout": dict(LLAMA4, moe_experts=16, moe_every=1, l2_qk_norm=True, max_position=10485760),
    "llama4-maverick": dict(LLAMA4, moe_experts=128, moe_every=2, l2_qk_norm=False, max_position=1048576),
}
