"""Shipped shapes of Gemma 3 (the text decoders of the published checkpoints; their
``config.json`` on the Hugging Face hub). Parameter counts equal transformers'
``Gemma3ForCausalLM`` on the same config (tests/test_gemma3.py)."""

from __future__ import annotations

GEMMA3 = dict(norm="gemma_rmsnorm", mlp="geglu", qk_norm=True, sandwich_norm=True, embed_scale=True,
              tie_embeddings=True, attn_head_dim=256, norm_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4,
              sliding_pattern=6, query_pre_attn_scalar=256.0, seq_len=8192)

PRESETS: dict[str, dict] = {
    "gemma-3-1b": dict(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_dim=6912, vocab_size=262144,
                       max_position=32768, sliding_window=512, **GEMMA3),
    # the 4B model's text decoder (Gemma3ForConditionalGeneration's language model); global
    # layers' RoPE linearly scaled by 8
    "gemma-3-4b": dict(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_dim=10240, vocab_size=262208,
                       max_position=131072, sliding_window=1024, rope_scaling="linear", rope_factor=8.0, **GEMMA3),
}
