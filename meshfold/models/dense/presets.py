"""Shipped shapes of the dense Llama-style family: Llama 2/3.x, Qwen2.5, Qwen3, Mistral, GPT-3,
and the tiny shapes of tests and the demo."""

from __future__ import annotations

LLAMA3 = dict(rope_theta=500000.0, vocab_size=128256, norm_eps=1e-5)
LLAMA31_ROPE = dict(max_position=131072, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_seq_len=8192)
QWEN2 = dict(vocab_size=151936, seq_len=4096, max_position=32768, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True)
QWEN3 = dict(vocab_size=151936, seq_len=4096, max_position=40960, rope_theta=1e6, norm_eps=1e-6, attn_head_dim=128,
             qk_norm=True)

PRESETS: dict[str, dict] = {
    # Tiny shapes for tests, the demo and CPU benchmarks.
    "debug": dict(dim=64, n_layers=2, n_heads=4, vocab_size=512, seq_len=64),
    "llama-20m": dict(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, vocab_size=8192, seq_len=256),
    "llama-125m": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, seq_len=1024),
    # Published shapes.
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000, seq_len=4096),
    "llama3-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                      tie_embeddings=True, **LLAMA3),
    "llama3-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                      tie_embeddings=True, **LLAMA3),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, seq_len=8192, **LLAMA3),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=8192, **LLAMA3),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, seq_len=8192,
                        **LLAMA3),
    # Hugging Face families for continued pre-training (docs/hf.md); seq_len is a training
    # default, the RoPE scaling is the published one. Llama 3.1 / 3.2 (llama3 RoPE scaling).
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, seq_len=8192,
                        **LLAMA3, **LLAMA31_ROPE),
    "llama3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=8192,
                         **LLAMA3, **LLAMA31_ROPE),
    "llama3.1-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, seq_len=8192,
                          **LLAMA3, **LLAMA31_ROPE),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                        tie_embeddings=True, **LLAMA3, **dict(LLAMA31_ROPE, rope_factor=32.0)),
    "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                        tie_embeddings=True, **LLAMA3, **dict(LLAMA31_ROPE, rope_factor=32.0)),
    # Qwen2.5 (biases on q/k/v only; the small ones tie their embeddings).
    "qwen2.5-0.5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, tie_embeddings=True,
                         **QWEN2),
    "qwen2.5-1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, tie_embeddings=True,
                         **QWEN2),
    "qwen2.5-3b": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008, tie_embeddings=True,
                       **QWEN2),
    "qwen2.5-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                       **dict(QWEN2, vocab_size=152064)),
    # Qwen3 (per-head q/k RMSNorm, head_dim 128 whatever dim / n_heads is).
    "qwen3-0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True, **QWEN3),
    "qwen3-1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True, **QWEN3),
    "qwen3-4b": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True, **QWEN3),
    "qwen3-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **QWEN3),
    # Mistral 7B v0.3 (no sliding window; v0.1's 4096-token window is not supported).
    "mistral-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
                       seq_len=8192, max_position=32768, rope_theta=1e6),
    # GPT-3 (Brown et al. 2020): learned positions, LayerNorm, GELU MLP, biases, tied embeddings.
    "gpt3-175b": dict(dim=12288, n_layers=96, n_heads=96, vocab_size=50257, seq_len=2048, norm="layernorm",
                      mlp="gelu", bias=True, pos="learned", tie_embeddings=True),
}
