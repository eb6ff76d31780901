"""Published training throughputs the cost model is checked against, each priced as its
job ran (device and power cap, parallel layout, micro-batch, recompute policy, kernels,
numerics), and the planner's prediction for each. ``benchmarks/planner_accuracy.py``
prints the table; ``tests/test_planner_published.py`` holds the bounds; ``docs/planner.md``
lists the sources. No constant of the cost model is fitted to these rows: the device
efficiencies come from kernel micro-benchmarks (``planner/cluster.py``, docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshfold.models.config import ModelConfig
from meshfold.models.presets import preset
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import Layout, Workload, estimate, megatron_flops_per_iteration

MEGATRON = "Narayanan et al., SC 2021 (Megatron-LM)"
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
KORTHIKANTI = "Korthikanti et al. 2022 (MLSys 2023), Reducing Activation Recomputation"


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    device: str  # cluster preset the job ran on
    gpus: int
    published: float
    unit: str  # "TFLOP/s/GPU" (Megatron's Eq. 3 FLOPs) | "s/step" | "tokens/s/GPU"
    bound: float | None  # relative error the tests allow (None: reported, not checked)
    model: ModelConfig
    workload: dict  # Workload fields besides the model
    layout: Layout
    overlap: float = 1.0  # data-parallel reduction hidden behind backward (Megatron 2021: none)


def _gpt(h: int, a: int, layers: int) -> ModelConfig:
    return ModelConfig(dim=h, n_layers=layers, n_heads=a, vocab_size=51200, seq_len=2048, norm="layernorm",
                       mlp="gelu", bias=True, pos="learned", tie_embeddings=True)


# Megatron-LM 2021, Table 1 (weak scaling, Selene: DGX A100 80GB): params B, heads, hidden,
# layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU. As run: fp16 with Megatron's fused
# kernels (LayerNorm, bias-GeLU, scale-mask-softmax, bias-dropout-add), no fused attention,
# dropout, full recompute, 1F1B, micro-batch 1 (not in the paper; its scripts ran others: below), and the
# data-parallel all-reduce after the backward (Megatron's local DDP of 2021 did not overlap it),
# pipeline sends scattered over tp and gathered after (its scatter/gather optimization, 4.1).
MEGATRON_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Table 1 as the paper's own scripts ran it (NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh``,
# commit de7dc40f88, 2021-08-10: "some of the scripts that were used to produce the results"):
# params -> micro-batch, layers per virtual stage (interleaved; 0: 1F1B) and ``--DDP-impl`` (torch:
# PyTorch's DDP, the all-reduce overlapped with the last micro-batch's backward; local: after it).
# The bounded rows above assume micro-batch 1, 1F1B and the local DDP everywhere;
# ``scripted_rows`` prices these (reported, not bounded: docs/planner.md, issue 44 fourth pass).
SC21_TABLE1_SCRIPTS = {
    1.7: (16, 0, "torch"), 3.6: (16, 0, "torch"), 7.5: (16, 0, "torch"), 18.4: (8, 0, "torch"),
    39.1: (4, 0, "local"), 76.1: (2, 5, "local"), 145.6: (2, 5, "local"), 310.1: (1, 3, "local"),
    529.6: (1, 1, "local"), 1008.0: (1, 0, "local"),
}
# Table 2 (PTD-P, GPT-3 175B, batch 1536, tp 8 x pp 8): GPUs, TFLOP/s per GPU.
MEGATRON_TABLE2 = [(384, 153), (768, 149), (1536, 141)]
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
# arXiv 2205.05198), Table 5: the end-to-end iteration time (s) of Megatron's full recompute
# (tp without sequence parallel: the paper's baseline) and of "present work" (sequence
# parallel + selective recompute), on Selene (DGX A100 80GB); the configurations of Table 3:
# params, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch, full s, selective s.
# As run: GPT-3 shapes (seq 2048, vocab 51200), fp16 with Megatron's fused kernels, dropout,
# no fused attention, 1F1B, one data-parallel replica; Megatron of 2022: the tp backward
# overlapped with the GEMMs and the weight gradients accumulated in fp32 by the GEMM
# (``LinearWithGradAccumulationAndAsyncCommunication``), pipeline sends scattered over tp;
# both years' jobs: Megatron's fp16 optimizer (``Workload.fp16_optimizer``).
# The 22B micro-batch of 4 (one per step) is what its Table 4 per-layer time (7.7 ms
# forward) implies; the others run 1.
# Held out: no constant of the cost model was fitted to these rows.
KORTHIKANTI_TABLE5 = [
    (22, 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10),
    (175, 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75),
    (530, 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83),
    (1000, 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49),
]
# torchtitan, end of 2024, Grand Teton H100 96GB at 500 W, bf16 (FSDP2 mixed precision:
# bf16 parameters in compute, fp32 reduce), seq 8192, eager unless noted (torch.compile:
# the blocks' memory-bound ops fused, ``kernels = "fused"``).
TORCHTITAN_ROWS = [
    # Table 1: Llama 3.1 8B, FSDP 8, local batch 2, selective (op) activation checkpointing
    # (meshfold's ``train.recompute = "op"``, ``parallel/recompute.py``)
    ("8B FSDP, 8 GPUs (Table 1)", "llama3-8b", 8, 5762, Layout(dp_shard=8, zero=3, micro_batch=2,
                                                                recompute="op"), dict()),
    ("8B FSDP + torch.compile, 8 GPUs (Table 1)", "llama3-8b", 8, 6667,
     Layout(dp_shard=8, zero=3, micro_batch=2, recompute="op"), dict(kernels="fused")),
    # Table 3: the same on 128 GPUs
    ("8B FSDP, 128 GPUs (Table 3)", "llama3-8b", 128, 5605,
     Layout(dp_shard=128, zero=3, micro_batch=2, recompute="op"), dict()),
    ("8B FSDP + torch.compile, 128 GPUs (Table 3)", "llama3-8b", 128, 6514,
     Layout(dp_shard=128, zero=3, micro_batch=2, recompute="op"), dict(kernels="fused")),
    # Table 4: Llama 3.1 70B, FSDP 32 x TP 8 (torchtitan's TP plan shards norms and residuals
    # over the sequence: sp), local batch 16, full AC, torch.compile + Float8
    ("70B FSDP 32 x TP 8, 256 GPUs (Table 4)", "llama3-70b", 256, 829,
     Layout(dp_shard=32, zero=3, tp=8, sp=True, micro_batch=16, recompute="full"), dict(fp8=True, kernels="fused")),
]


def rows() -> list[Row]:
    out = []
    for params, a, h, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE1:
        out.append(Row(f"{params}B, {gpus} GPUs (Table 1)", MEGATRON, "a100-dgx", gpus, tflops, "TFLOP/s/GPU", 0.15,
                       _gpt(h, a, layers), dict(global_batch=batch, dtype="bf16", flash=False, dropout=True,
                                                kernels="fused", pp_scatter_gather=True,
                                                fp16_optimizer=True),
                       Layout(dp_replicate=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=1, recompute="full"),
                       overlap=0.0))
    for gpus, tflops in MEGATRON_TABLE2:
        out.append(Row(f"175B PTD-P, {gpus} GPUs (Table 2)", MEGATRON, "a100-dgx", gpus, tflops, "TFLOP/s/GPU", 0.15,
                       _gpt(12288, 96, 96), dict(global_batch=1536, dtype="bf16", flash=False, dropout=True,
                                                 kernels="fused", pp_scatter_gather=True,
                                                 fp16_optimizer=True),
                       Layout(dp_shard=gpus // 64, zero=1, tp=8, pp=8, micro_batch=1, recompute="full"),
                       overlap=0.0))
    for params, a, h, layers, tp, pp, gpus, batch, mb, full_s, selective_s in KORTHIKANTI_TABLE5:
        size = f"{params // 1000}T" if params >= 1000 else f"{params}B"
        for recompute, sp, seconds in (("full", False, full_s), ("selective", True, selective_s)):
            out.append(Row(f"{size} {recompute}{' + sp' if sp else ''}, {gpus} GPUs (Table 5)", KORTHIKANTI,
                           "a100-dgx", gpus, seconds, "s/step", 0.15, _gpt(h, a, layers),
                           dict(global_batch=batch, dtype="bf16", flash=False, dropout=True, kernels="fused",
                                tp_overlap=True, wgrad_fused=True, pp_scatter_gather=True,
                                fp16_optimizer=True),
                           Layout(dp_replicate=gpus // (tp * pp), tp=tp, sp=sp, pp=pp, micro_batch=mb,
                                  recompute=recompute), overlap=0.0))
    for name, model, gpus, tps, layout, extra in TORCHTITAN_ROWS:
        # issue 33 bounds the eager 8B rows and the 70B row; the 8B torch.compile rows are
        # reported beside them (the fused profile is what compile could reach: +24-28 %)
        compiled_8b = "compile" in name and "8B" in name
        out.append(Row(name, TORCHTITAN, "h100-grand-teton", gpus, tps, "tokens/s/GPU",
                       None if compiled_8b else 0.20, preset(model),
                       dict(global_batch=layout.dp * layout.micro_batch, seq_len=8192, dtype="bf16", flash=True,
                            **extra), layout))
    return out


def scripted_rows() -> list[Row]:
    """Megatron 2021's Table 1 priced as ``SC21_TABLE1_SCRIPTS`` ran it (reported beside the
    bounded rows by ``benchmarks/planner_accuracy.py --sc21``)."""
    out = []
    for row, (params, *_, layers, tp, pp, gpus, _b, _t) in zip(rows(), MEGATRON_TABLE1):
        mb, per_chunk, ddp = SC21_TABLE1_SCRIPTS[params]
        v = layers // pp // per_chunk if per_chunk else 1
        layout = replace(row.layout, micro_batch=mb, pp_schedule="interleaved" if v > 1 else row.layout.pp_schedule,
                         pp_virtual_stages=v)
        out.append(replace(row, name=row.name.replace("(Table 1)", "(Table 1, scripted)"), bound=None, layout=layout,
                           overlap=1.0 if ddp == "torch" else 0.0))
    return out


def predict(row: Row) -> dict:
    """The planner's number for a row, in the row's unit, with the estimate behind it."""
    cluster = replace(load_cluster(row.device, devices=row.gpus), overlap=row.overlap)
    w = Workload(row.model, **row.workload)
    est = estimate(w, cluster, row.layout)
    if row.unit == "s/step":
        value = est.step_time_s
    elif row.unit == "tokens/s/GPU":
        value = w.global_batch * w.s / est.step_time_s / row.gpus
    else:  # Megatron's Eq. 3 FLOPs (with the recompute pass) per second per GPU
        m = row.model
        value = megatron_flops_per_iteration(w.global_batch, w.s, m.n_layers, m.dim, m.vocab_size) \
            / est.step_time_s / row.gpus / 1e12
    return {"name": row.name, "source": row.source, "device": row.device, "gpus": row.gpus, "unit": row.unit,
            "published": row.published, "predicted": value, "error": value / row.published - 1,
            "bound": row.bound, "layout": row.layout.short(), "mfu": est.mfu, "fits": est.fits,
            "peak_mem_gib": est.peak_mem_bytes / 2**30, "estimate": est}
