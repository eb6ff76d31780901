"""Measure the per-document cost model W(l) = a l^2 + b l on this machine.

Forward + backward of one block of the configured model (per-document attention, as the
balanced loader runs it; parameters and autocast as the run has them, on the rank's
device), scaled to the model's layers and output projection, on micro-batches of k documents of l tokens, for several l (k = 1, and k*l about
twice the longest); the fastest of a few repeats per length (CPU seconds of the process on CPU, so waiting
for a core on a shared machine does not count; synchronised wall time on GPUs) is fitted by non-negative least squares
to  time = k (a l^2 + b l) + c.  The constant c is the per-micro-batch overhead, paid
once per micro-batch whatever it holds, so it is not part of a document's W. The planner can call ``measure_cost`` for the same numbers.

``meshfold calibrate-cost CONFIG.toml`` prints a and b (and the ``--set`` lines that pin
them); a run with ``data.cost_a = data.cost_b = 0`` measures at start on global rank 0,
caches the result per model shape / dtype / device, and broadcasts it so every rank
plans with the same numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.data.balance import DocumentCost
from meshfold.data.tokenizer import cache_root
from meshfold.models.config import ModelConfig
from meshfold.device import resolve_dtypes
from meshfold.models.llama import TransformerBlock, init_weights, rope_tables
from meshfold.models.counts import attention_params, ffn_params

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


@dataclass
class CostFit:
    a: float
    b: float
    c: float
    lengths: list[int]
    seconds: list[float]  # per micro-batch of counts[i] documents of lengths[i] tokens
    counts: list[int]

    @property
    def model(self) -> DocumentCost:
        return DocumentCost(self.a, self.b)

    def rel_error(self) -> float:
        """Largest relative error of the fit (a l^2 + b l + c) over the measured points."""
        l = np.asarray(self.lengths, dtype=np.float64)
        pred = np.asarray(self.counts) * (self.a * l * l + self.b * l) + self.c
        t = np.asarray(self.seconds)
        return float(np.max(np.abs(pred - t) / t))


def default_lengths(seq_len: int, n: int = 6) -> list[int]:
    lo = max(8, seq_len // 16)
    return sorted({int(x) for x in np.linspace(lo, seq_len, n)})


def measure_cost(model_cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 lengths: list[int] | None = None, repeats: int = 3, seed: int = 0,
                 row_tokens: int = 0, autocast_dtype: torch.dtype | None = None) -> CostFit:
    """Time micro-batches of ``k`` documents of ``l`` tokens (k = 1 and k*l about
    ``row_tokens``, default 2 * the longest length) through ONE transformer block (one of
    each kind, dense and MoE, where the model mixes them) with parameters in ``dtype`` under
    ``autocast_dtype`` on ``device``, as the run computes, and fit time = k (a l^2 + b l) + c
    for the whole model: the blocks' times summed over the layers, and the output
    projection's per-token matmul added to b in proportion to its parameters (it is linear
    in l). The whole model is never built: at 70B it would not fit on one device."""

    device = torch.device(device)
    lengths = lengths or default_lengths(model_cfg.seq_len)
    layers_of_kind = Counter(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers))
    blocks = []  # (block, how many layers of the model are of its kind)
    for moe, count in sorted(layers_of_kind.items()):
        layer_id = next(i for i in range(model_cfg.n_layers) if model_cfg.is_moe_layer(i) == moe)
        block = TransformerBlock(model_cfg, layer_id)
        init_weights(block, model_cfg, seed)
        blocks.append((block.to(device=device, dtype=dtype), count))
    cos, sin = (t.to(device=device, dtype=torch.float32) for t in rope_tables(model_cfg))
    gen = torch.Generator().manual_seed(seed)
    # Each length alone and k to a row: varying the row's total tokens separates the
    # per-document cost from the per-micro-batch overhead c.
    row_tokens = row_tokens or 2 * max(lengths)
    points = sorted({(l, k) for l in lengths for k in (1, max(2, row_tokens // l))})
    lengths, counts = [l for l, _ in points], [k for _, k in points]

    # On CPU, the process's CPU seconds: time spent waiting for a core on a shared machine
    # is not the model's cost. On GPUs, synchronised wall time.
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def autocast():
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    def once(block, l: int, k: int) -> float:
        """One micro-batch of k documents of l tokens each through ``block``, forward + backward."""
        h = torch.randn(1, k * l, model_cfg.dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        doc_ids = torch.arange(k, device=device).repeat_interleave(l).unsqueeze(0)
        positions = torch.arange(l, device=device).repeat(k).unsqueeze(0)
        rope = (cos[positions], sin[positions])
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        with autocast():
            out = block(h, rope, positions, doc_ids)
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        block.zero_grad(set_to_none=True)
        return clock() - start

    def model_time(l: int, k: int) -> float:
        # The fastest of a few repeats: the least disturbed by other work on the machine.
        return sum(count * min(once(block, l, k) for _ in range(repeats)) for block, count in blocks)

    for block, _ in blocks:  # warm-up: every shape once
        for l, k in zip(lengths, counts):
            once(block, l, k)
    fit = fit_cost(lengths, counts, [model_time(l, k) for l, k in zip(lengths, counts)])
    layer_params = sum(attention_params(model_cfg) + ffn_params(model_cfg, i, True) for i in range(model_cfg.n_layers))
    fit.b *= 1 + model_cfg.vocab_size * model_cfg.dim / max(1, layer_params)  # + the output projection
    return fit


def fit_cost(lengths: list[int], counts: list[int], seconds: list[float]) -> CostFit:
    """Non-negative least squares of time = k (a l^2 + b l) + c over the measured points."""
    from scipy.optimize import nnls

    l = np.asarray(lengths, dtype=np.float64)
    k = np.asarray(counts, dtype=np.float64)
    # Columns scaled so nnls is well conditioned, then undone.
    cols = np.stack([k * l * l, k * l, np.ones_like(l)], axis=1)
    norm = cols.max(axis=0)
    coef, _ = nnls(cols / norm, np.asarray(seconds, dtype=np.float64))
    a, b, c = (coef / norm).tolist()
    return CostFit(a, b, c, list(map(int, lengths)), list(map(float, seconds)), list(map(int, counts)))


def _cache_file(cfg: Config, device: torch.device, dtype: torch.dtype, autocast_dtype: torch.dtype | None):

    m = cfg.model
    key = json.dumps(["block", str(autocast_dtype), m.moe_every, m.moe_first_dense, m.moe_ffn_dim, m.dim, m.n_layers, m.n_heads, m.kv_heads, m.hidden_dim, m.vocab_size, m.seq_len,
                      m.moe_experts, m.moe_topk, str(dtype), device.type, torch.__version__, torch.get_num_threads()])
    return cache_root(cfg.data.cache_dir) / f"cost-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def cost_model_for(cfg: Config, device: torch.device, dtype: torch.dtype) -> DocumentCost:
    """``data.cost_a/cost_b`` when set; otherwise measured (cached) on global rank 0 on one
    block under the run's autocast (``measure_cost``) and broadcast, so every rank plans
    identically. ``dtype``: the parameters' dtype; ``train.dtype`` gives the autocast."""
    d = cfg.data
    if d.cost_a or d.cost_b:
        return DocumentCost(d.cost_a, d.cost_b)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    ab = torch.zeros(2, dtype=torch.float64, device=device)
    if not distributed or dist.get_rank() == 0:
        _, autocast_dtype = resolve_dtypes(cfg.train.dtype, device)
        path = _cache_file(cfg, device, dtype, autocast_dtype)
        if path.exists():
            got = json.loads(path.read_text())
            ab = torch.tensor([got["a"], got["b"]], dtype=torch.float64, device=device)
        else:
            fit = measure_cost(cfg.model, device, dtype, autocast_dtype=autocast_dtype)
            ab = torch.tensor([fit.a, fit.b], dtype=torch.float64, device=device)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"a": fit.a, "b": fit.b, "c": fit.c, "lengths": fit.lengths,
                                        "seconds": fit.seconds}))
    if distributed:
        comm.broadcast(ab, 0, None, "data")
    a, b = ab.tolist()  # once, at start-up
    return DocumentCost(a, b)
