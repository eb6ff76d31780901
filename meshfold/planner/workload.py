"""What the planner prices: the workload (model, batch, numerics), a layout (the
``[parallel]`` section plus micro-batch and recompute) and the estimate it returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshfold.layout import ParallelConfig
from meshfold.models.config import ModelConfig
from meshfold.schedules import Schedule, get_schedule

# The schedule a layout without pipeline stages (pp = 1) names: the runtime's default.
DEFAULT_SCHEDULE = ParallelConfig.pp_schedule


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the batch and the numerics."""

    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    seq_len: int = 0  # 0 = model.seq_len
    dtype: str = "bf16"  # bf16 | bf16-amp (meshfold's bfloat16: fp32 params) | float32 | float64
    flash: bool = True  # fused attention: no s^2 activations, causal half of the score FLOPs
    dropout: bool = False  # GPT/Megatron-style dropout masks (Korthikanti's 34 sbh)
    # How the memory-bound ops run (the bytes ``elementwise_bytes`` counts): "eager" =
    # one PyTorch kernel per op as meshfold's (and torchtitan's) model code writes them;
    # "fused" = hand-fused kernels (Megatron) or torch.compile's fusions.
    kernels: str = "eager"
    fp8: bool = False  # Float8 linears (torchao): GEMMs at the fp8 peak, plus their casts
    fp8_recipe: str = "none"  # train.fp8 (its tp scale reductions: planner/fp8.py)
    fp8_all_gather: bool = False  # FSDP2 gathers the converted linears' weights in fp8 (planner/fp8.py)
    fp8_dispatch: bool = False  # parallel.ep_fp8_dispatch: routed rows dispatched in fp8 (planner/fp8.py)
    # Tensor parallel's backward collectives of the column-parallel linears run beside the
    # GEMM that does not need them (Megatron since late 2021, ``layer._tp_backward``);
    # False: one after the other on the compute stream, as meshfold's ``parallel/tp`` issues them
    tp_overlap: bool = False
    # Weight gradients accumulated inside the weight-gradient GEMM (Megatron's gradient-
    # accumulation fusion, 2022): no pass adding each micro-batch's gradients into the held ones
    wgrad_fused: bool = False
    # Pipeline sends split over the tp ranks and all-gathered after (Megatron's scatter/gather
    # optimization); False: every tp rank sends the whole activations (meshfold's pp)
    pp_scatter_gather: bool = False
    # Megatron's fp16 optimizer (``Float16OptimizerWithFloat16Params``): fp32 main gradients
    # unscaled and checked for infs, Adam on the fp32 main parameters, then copied into the
    # fp16 model parameters and the gradient buffer zeroed (``step.MEGATRON_OPTIMIZER_BYTES``)
    fp16_optimizer: bool = False
    optimizer: str = "adamw"  # train.optimizer (planner/optimizer.py prices each kind)
    muon_ns_steps: int = 5  # train.muon_ns_steps: Newton-Schulz iterations per matrix
    aligned_groups: bool = True  # grouped-GEMM expert groups padded to 16 bytes (CUDA's kernel; not the CPU's)
    cp_balance: bool = True  # parallel.cp_balance: which ring blocks windowed / chunked layers see (attention/ring.py)

    @property
    def s(self) -> int:
        return self.seq_len or self.model.seq_len


@dataclass(frozen=True)
class Layout:
    """A plan: the ``[parallel]`` section plus micro-batch size and recomputation."""

    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = DEFAULT_SCHEDULE
    pp_virtual_stages: int = 1
    cp: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 0  # hybrid: the Ulysses degree (layout_from_config resolves 0 as the runtime)
    ep: int = 1
    ep_overlap_chunks: int = 1  # ep all-to-all pipelined in this many chunks (``parallel.ep_overlap_chunks``)
    expert_tp: int = 1  # 1: whole experts over ep x tp; tp: each expert split over tp (``parallel.expert_tp``)
    micro_batch: int = 1  # sequences per micro-batch on one data-parallel rank
    recompute: str = "none"  # none | selective | op | full (parallel/recompute.py)
    pp_split: tuple = ()  # blocks per stage (``parallel.pp_split``); () = balanced by cost, as the runtime
    # skippipe's skip cap and reorder option, and links between pp ranks slower or faster
    # than the cluster's ((a, b, Mbit/s), ...: ``parallel.pp_links``), priced per link
    pp_skip: float = 0.0
    pp_reorder: bool = False
    pp_links: tuple = ()

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def schedule(self) -> Schedule:
        """The registered pipeline schedule ``pp_schedule`` names (``meshfold/schedules``)."""
        return get_schedule(self.pp_schedule)

    @property
    def virtual(self) -> int:
        """``pp_virtual_stages`` as the schedule reads it (1 where it has no virtual stages)."""
        return self.schedule.virtual_of(self.pp_virtual_stages)

    def microbatches(self, global_batch: int) -> int:
        return global_batch // self.dp // self.micro_batch

    def parallel_config(self, global_batch: int) -> ParallelConfig:
        return ParallelConfig(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                              zero=self.zero if (self.dp_shard * self.cp > 1 or self.zero <= 1) else self.zero,
                              tp=self.tp, sp=self.sp, pp=self.pp, pp_schedule=self.pp_schedule,
                              pp_microbatches=self.microbatches(global_batch) if self.pp > 1 else 0,
                              pp_virtual_stages=self.pp_virtual_stages, cp=self.cp, cp_mode=self.cp_mode,
                              cp_ulysses=self.cp_ulysses if self.cp_mode == "hybrid" else 0,
                              ep=self.ep, ep_overlap_chunks=self.ep_overlap_chunks if self.ep > 1 else 1,
                              expert_tp=self.expert_tp,
                              pp_split=list(self.pp_split), pp_skip=self.pp_skip,
                              pp_reorder=self.pp_reorder, pp_links=[list(x) for x in self.pp_links])

    def config_values(self, global_batch: int) -> dict[str, dict]:
        """The layout as config keys: the whole ``[parallel]`` it sets and its ``[train]`` keys."""
        p = self.parallel_config(global_batch)
        keys = ("dp_replicate", "dp_shard", "zero", "tp", "sp", "pp", "pp_schedule", "pp_microbatches",
                "pp_virtual_stages", "cp", "cp_mode", "ep") + (("pp_split",) if self.pp_split else ())
        keys += ("ep_overlap_chunks",) if self.ep > 1 and self.ep_overlap_chunks > 1 else ()
        keys += ("expert_tp",) if self.expert_tp > 1 else ()
        return {"parallel": {key: getattr(p, key) for key in keys},
                "train": {"global_batch": global_batch, "micro_batch": self.micro_batch, "recompute": self.recompute}}

    def to_toml(self, global_batch: int) -> str:
        values = self.config_values(global_batch)
        lines = ["[parallel]"]
        for key, value in values["parallel"].items():
            lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value).replace(chr(39), chr(34))}")
        t = values["train"]
        lines += ["", "[train]", f"global_batch = {t['global_batch']}",
                  f"micro_batch = {t['micro_batch']}", f'recompute = "{t["recompute"]}"']
        return "\n".join(lines) + "\n"

    def short(self) -> str:
        parts = [f"dp{self.dp_replicate}x{self.dp_shard}", f"z{self.zero}", f"tp{self.tp}" + ("sp" if self.sp else "")]
        if self.pp > 1:
            v = f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(f"pp{self.pp} {self.pp_schedule}{v}" + (f" split{list(self.pp_split)}" if self.pp_split else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp} {self.cp_mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"c{self.ep_overlap_chunks}" if self.ep_overlap_chunks > 1 else ""))
        parts += [f"etp{self.expert_tp}"] if self.expert_tp > 1 else []
        parts += [f"mb{self.micro_batch}", self.recompute]
        return " ".join(parts)


@dataclass
class Estimate:
    layout: Layout
    step_time_s: float
    time: dict  # seconds by component, on the slowest pipeline stage
    memory: dict  # bytes by component, on the device that holds the most
    peak_mem_bytes: float
    fits: bool
    model_flops: float  # per step, whole cluster (3x forward, no recompute)
    mfu: float
    tflops_per_device: float  # model FLOPs / step time / devices
    comm_bytes: dict = field(default_factory=dict)  # rank 0, per step, by dimension
    # What ``meshfold dry-run`` prints next to the runtime (``footprint``): per rank, max
    # over ranks, bytes of parameters, gradients, optimizer states and activations
    # (docs/memory.md defines each term)...
    param_bytes: float = 0.0
    gathered_param_bytes: float = 0.0
    recompute_bytes: float = 0.0
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes: float = 0.0
    # ... and rank 0's collectives per step by mesh dimension: {dim: {"count", "bytes"}}
    collectives: dict = field(default_factory=dict)
    # the values of the keys the search chose ({"train.optimizer": "muon"}; planner/choices.py)
    choices: dict = field(default_factory=dict)

    @property
    def optimizer(self) -> str:
        """The optimizer kind it was priced with, where the search chose it (train.optimizer = auto)."""
        return self.choices.get("train.optimizer", "")

    def footprint(self) -> dict:
        return {"param_bytes": self.param_bytes, "gathered_param_bytes": self.gathered_param_bytes,
                "recompute_bytes": self.recompute_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activation_bytes": self.activation_bytes,
                "collectives": self.collectives}

    def row(self) -> dict:
        return {"layout": self.layout.short(), "step_time_s": self.step_time_s, "mfu": self.mfu,
                "tflops_per_device": self.tflops_per_device, "peak_mem_bytes": self.peak_mem_bytes,
                "fits": self.fits}
