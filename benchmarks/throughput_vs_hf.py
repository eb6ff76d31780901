"""Tokens/s of meshfold's training step against a Hugging Face `transformers`
LlamaForCausalLM training loop of the same shape, batch, dtype and data, in one process.

    .venv/bin/python benchmarks/throughput_vs_hf.py [--shapes debug llama-20m] [--compile|--no-compile]

Both sides: fused AdamW (transformers' Trainer default with torch >= 2.8; meshfold's
`train.fused_optimizer = auto`), gradient clipping at 1.0, the same token batches from
meshfold's data pipeline, the same thread count. meshfold runs its real `Trainer.train_step`
(data loading included); the baseline runs `model(input_ids).logits` + cross-entropy +
backward + clip + step. Rounds alternate between the two so machine noise hits both;
the ratio of median step times is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshfold.config import Config, validate
from meshfold.models.counts import param_count
from meshfold.models.presets import preset
from meshfold.train.trainer import Trainer


def hf_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hf_cfg)


def time_steps(step_fn, n):
    out = []
    for _ in range(n):
        start = time.perf_counter()
        step_fn()
        out.append(time.perf_counter() - start)
    return out


def bench(shape: str, batch: int, compile_blocks: bool, rounds: int, steps: int) -> dict:
    cfg = Config(model=preset(shape))
    cfg.data.doc_mask = False  # the baseline has no document masking; compare like with like
    cfg.train.global_batch = batch
    cfg.train.steps = 10**6
    cfg.train.dtype = "float32"
    cfg.train.compile = compile_blocks
    cfg.train.progress = False
    cfg.train.run_dir = "/tmp/meshfold-bench"
    validate(cfg, 1)
    trainer = Trainer(cfg)

    torch.manual_seed(0)
    model = hf_model(cfg.model)
    # fused: what transformers' Trainer picks by default with torch >= 2.8 ("adamw_torch_fused")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batches = [trainer.local_batch() for _ in range(4)]

    def hf_step(i=[0]):
        b = batches[i[0] % len(batches)]
        i[0] += 1
        logits = model(input_ids=b["inputs"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up (and compilation)
        trainer.train_step()
        hf_step()
    ours, theirs = [], []
    for _ in range(rounds):
        ours += time_steps(trainer.train_step, steps)
        theirs += time_steps(hf_step, steps)
    tokens = batch * cfg.model.seq_len
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    return {"shape": shape, "params": param_count(cfg.model), "batch": batch, "seq": cfg.model.seq_len,
            "compile": compile_blocks, "meshfold_tok_s": tokens / m_ours, "hf_tok_s": tokens / m_theirs,
            "ratio": m_theirs / m_ours}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["debug", "llama-20m"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'shape':<11} {'params':>11} {'batch x seq':>11} {'compile':>7} {'meshfold tok/s':>15} "
          f"{'HF tok/s':>10} {'ratio':>6}")
    for shape in args.shapes:
        r = bench(shape, args.batch, args.compile, args.rounds, args.steps)
        print(f"{r['shape']:<11} {r['params']:>11,} {r['batch']:>5} x {r['seq']:<4} {str(r['compile']):>7} "
              f"{r['meshfold_tok_s']:>15,.0f} {r['hf_tok_s']:>10,.0f} {r['ratio']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
