"""The fake-CUDA matrix (issue #26 item 2): layouts and features run as ``meshfold dry-run
--device cuda`` runs a rank (meshfold/gpucheck.py), on small shapes; and the recorder
itself, in-process.

Each matrix case asserts: ``gpu.errors`` empty (host tensors in device computations or
collectives, math attention, dense [S, S] masks), no math-kernel attention, no host sync
inside a layer (per-step reads are allowed and counted), every transformer block entered
in bf16 (the residual stream in the compute dtype, as FSDP2 and Megatron run it: bf16
compute weights in every layout), and bf16 on the dp/tp/cp/pp wires when the compute dtype
is bf16 (``train.dtype = auto``, resolved for the h100 cluster as the dry-run resolves it).
A payload in another dtype on those wires must be one of (every place that sent it is
checked): gradients reduced in ``train.reduce_dtype`` (float32 as configured: FSDP2's
reduce-scatter, DDP's and ``GradReducer``'s all-reduce, a compression codec's encoding of
them); the vocabulary-parallel cross-entropy's per-token max and sums over tp and ring
attention's dK/dV accumulators around the cp ring, in float32 as Megatron and torch's
context parallel send them; integer metadata or codec bytes; or a float64 statistic of the
MoE router, or the step's statistics the pipeline (loss, timings) and context parallel
(attention work) gather.
The one sync allowed inside a layer is dropless MoE's variable all-to-all's split sizes
(``parallel/ep/dispatch.py``: NCCL takes them on the host; docs/gpu.md); capacity mode has none.

Cases that fail on a defect not fixed yet are ``xfail(strict=True)`` with the defect: when
it is fixed the case passes and the mark must go.

All cases run in one pass: one forkserver that imported meshfold once, a fresh child per
case (torch caches meshes, groups and DTensor state per process), two at a time.
"""

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshfold import gpucheck
from meshfold.comm import HostTensorMode
from meshfold.config import from_dict, validate
from meshfold.dryrun import _in_fresh_processes, _real_mesh_tensors, simulate_rank, with_target_numerics
from meshfold.layout import ParallelConfig
from meshfold.mesh import build_mesh

WIRES = ("dp", "dp_shard", "dp_replicate", "dp_cp", "dp_shard_cp", "edp", "ep", "tp", "cp", "pp")
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "seq_len": 64}
MOE = {"moe_experts": 4, "moe_topk": 2, "moe_every": 1, "moe_ffn_dim": 32}
NO_DOCS = {"doc_mask": False}  # layouts are checked on plain causal rows; documents have their own cases



def case(world, parallel, model=None, train=None, data=None, lowcomm=None, xfail=None):
    return world, parallel, model or {}, train or {}, {**NO_DOCS, **(data or {})}, lowcomm or {}, xfail


CASES = {
    "ddp": case(2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}),
    "zero1": case(2, {"dp_shard": 2, "zero": 1}),
    "zero2-recompute-selective": case(2, {"dp_shard": 2, "zero": 2}, train={"recompute": "selective"}),
    "zero3-recompute-full": case(2, {"dp_shard": 2, "zero": 3}, train={"recompute": "full"}),
    "hsdp": case(4, {"dp_replicate": 2, "dp_shard": 2, "zero": 3}),
    "offload-params": case(2, {"dp_shard": 2, "zero": 3}, train={"offload": "params"}),
    "offload-optimizer": case(2, {"dp_shard": 2, "zero": 3}, train={"offload": "optimizer"}),
    "tp-sp-fsdp": case(4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3}),
    "tp-zero1": case(4, {"tp": 2, "dp_shard": 2, "zero": 1}),
    "pp-gpipe": case(2, {"pp": 2, "dp_shard": 1, "pp_schedule": "gpipe", "pp_microbatches": 2}),
    "pp-1f1b": case(2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b", "pp_microbatches": 2}),
    "pp-interleaved": case(2, {"pp": 2, "dp_shard": 1, "pp_schedule": "interleaved", "pp_virtual_stages": 2,
                               "pp_microbatches": 2}, model={"n_layers": 4}),
    "pp-zbv": case(2, {"pp": 2, "dp_shard": 1, "pp_schedule": "zbv", "pp_microbatches": 2}, model={"n_layers": 4}),
    "cp-ring": case(2, {"cp": 2, "dp_shard": 1, "cp_mode": "ring"}),
    "cp-ulysses": case(2, {"cp": 2, "dp_shard": 1, "cp_mode": "ulysses"}),
    "cp-hybrid": case(4, {"cp": 4, "dp_shard": 1, "cp_mode": "hybrid", "cp_ulysses": 2}),
    "doc-mask": case(2, {"dp_shard": 2, "zero": 3}, data={"doc_mask": True}),
    "doc-mask-cp-ring": case(2, {"cp": 2, "dp_shard": 1, "cp_mode": "ring"}, data={"doc_mask": True}),
    "moe-ep": case(4, {"dp_shard": 4, "zero": 3, "ep": 2}, model=MOE),
    "moe-ep-tp": case(8, {"tp": 2, "dp_shard": 4, "zero": 3, "ep": 2}, model=MOE),
    "moe-ep-tp-sp": case(8, {"tp": 2, "sp": True, "dp_shard": 4, "zero": 3, "ep": 2}, model=MOE),
    # capacity mode: fixed slots padded to capacity, equal-split all-to-alls (no split sizes)
    "moe-ep-capacity": case(4, {"dp_shard": 4, "zero": 3, "ep": 2}, model={**MOE, "moe_capacity_factor": 1.0}),
    "moe-ep-tp-capacity": case(8, {"tp": 2, "dp_shard": 4, "zero": 3, "ep": 2},
                               model={**MOE, "moe_capacity_factor": 1.25}),
    # DeepSeek-V3's layout: ep over ZeRO-1 (bf16 gathered into the compute weights, dense over the
    # 4 data ranks, experts over edp = 2) and over DDP
    "moe-ep-zero1": case(4, {"dp_shard": 4, "zero": 1, "ep": 2}, model=MOE),
    "moe-ep-zero0": case(4, {"dp_replicate": 4, "dp_shard": 1, "zero": 0, "ep": 2}, model=MOE),
    # the all-to-all pipelined in chunks (async dispatch/combine over the experts' compute)
    "moe-ep-overlap": case(4, {"dp_shard": 4, "zero": 3, "ep": 2, "ep_overlap_chunks": 3}, model=MOE),
    "moe-ep-capacity-overlap": case(4, {"dp_shard": 4, "zero": 3, "ep": 2, "ep_overlap_chunks": 2},
                                    model={**MOE, "moe_capacity_factor": 1.0}),
    "balance": case(2, {"dp_shard": 2, "zero": 3}, data={"doc_mask": True, "balance": "greedy"}),
    "diloco": case(4, {"dp_shard": 2, "zero": 3}, lowcomm={"method": "diloco", "workers": 2, "inner_steps": 2}),
    "powersgd": case(2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}, lowcomm={"compression": "powersgd"}),
    "onebit": case(2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}, lowcomm={"compression": "onebit"}),
}


def _config(world, parallel, model, train, data, lowcomm, _xfail=None):
    d = {"model": {**MODEL, **model}, "parallel": parallel,
         "train": {"steps": 2, "global_batch": 4 * max(1, parallel.get("pp", 1)), "dtype": "auto",
                   "run_dir": "/tmp/unused", "progress": False, "tensorboard": False, **train},
         "data": data, "lowcomm": lowcomm}
    return with_target_numerics(validate(from_dict(d), world), "h100")


@pytest.fixture(scope="module")
def matrix():
    cfgs = {n: _config(*c) for n, c in CASES.items()}
    calls = [(cfgs[n], CASES[n][0], 0, "cuda") for n in CASES]
    return dict(zip(CASES, _in_fresh_processes(simulate_rank, calls, 2))), cfgs


def _wire_ok(dim: str, dtype: str, place: str, cfg) -> bool:
    """A non-bf16 payload on a dp/tp/cp/pp wire that is what the config asks for, or what
    Megatron and torch send there too (see the module doc)."""
    op, _, where = place.partition(" from ")
    if dtype == "float32":
        if where.startswith("meshfold/parallel/loss.py"):  # vocabulary-parallel CE's per-token max and sums
            return dim == "tp"
        if where.startswith("meshfold/parallel/cp/"):  # ring backward's dK/dV accumulators
            return dim == "cp"
        if where.startswith("meshfold/lowcomm/codecs/"):  # a codec's encoding of the (fp32) gradients
            return cfg.train.reduce_dtype == "float32" and dim.startswith("dp")
        reduce = cfg.train.reduce_dtype == "float32"  # gradients reduced in the configured dtype:
        all_reduce = op in ("allreduce", "all_reduce")  # (torch's op name, comm.py's)
        if cfg.parallel.zero >= 2:  # FSDP2's reduce-scatter (HSDP: then over replicas)
            return reduce and ("reduce_scatter" in op or (all_reduce and dim == "dp_replicate"))
        return reduce and all_reduce and dim.startswith("dp")  # DDP's / GradReducer's all-reduce
    if dtype == "float64":  # the router's statistics; the step's statistics over pp and cp (loss, timings, work)
        return where.startswith("meshfold/parallel/ep/") or \
            (dim == "pp" and where.startswith("meshfold/parallel/pp/executor.py")) or \
            (dim == "cp" and where.startswith("meshfold/parallel/cp/"))
    return dtype.startswith(("int", "uint"))


def findings(g: dict, cfg) -> list[str]:
    out = [f"error: {e}" for e in g["errors"]]
    if set(g["block_inputs"]) != {"bfloat16"}:  # the residual stream in the compute dtype, as FSDP2 and Megatron run it
        out.append(f"blocks entered in {g['block_inputs']}")
    if "math" in g["attention"]:
        out.append(f"math attention: {g['attention']}")
    out += [f"host sync inside a layer: {p}" for p in g["in_layer"]
            if not (p.startswith("meshfold/parallel/ep/") and p.endswith("(tolist)"))]
    for dim, dtypes in g["wire_dtypes"].items():
        if dim not in WIRES:
            continue
        sources = {dt: g["wire_sources"].get(f"{dim} {dt}", [""]) for dt in dtypes}
        if "bfloat16" not in dtypes and not all(_wire_ok(dim, dt, p, cfg) for dt in dtypes for p in sources[dt]):
            out.append(f"no bf16 on the {dim} wire: {dtypes}")
        out += [f"{dt} on the {dim} wire: {p}" for dt in dtypes if dt != "bfloat16" for p in sources[dt]
                if not _wire_ok(dim, dt, p, cfg)]
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=c[-1]))
                                  if c[-1] else n for n, c in CASES.items()])
def test_fake_cuda_case(matrix, name):
    results, cfgs = matrix
    g, cfg = results[name]["gpu"], cfgs[name]
    assert cfg.train.dtype == "bfloat16", name  # auto resolved for the GPU cluster
    assert sum(g["syncs"].values()) >= 1, name  # the step's loss read is always counted
    bad = findings(g, cfg)
    assert not bad, f"{name}:\n" + "\n".join(bad)
    if name == "doc-mask":  # packed documents: flash varlen, its runs found by the loader on the host
        assert set(g["attention"]) == {"flash-varlen"}, g["attention"]
        assert not any("attention_ops" in place for place in g["syncs"]), g["syncs"]


@pytest.mark.parametrize("name", ["moe-ep-capacity", "moe-ep-tp-capacity", "moe-ep-capacity-overlap"])
def test_capacity_mode_reads_nothing_on_the_host_inside_a_layer(matrix, name):
    """Under a capacity the MoE layers run in fixed slots with equal-split all-to-alls: no
    host read inside any layer (dropless reads the split sizes once per MoE layer and
    micro-batch), and rank 0's whole step within the issue's 4 host syncs."""
    g = matrix[0][name]["gpu"]
    assert g["in_layer"] == [], g["in_layer"]
    assert sum(g["syncs"].values()) <= 4, g["syncs"]
    assert "int64" not in g["wire_dtypes"]["ep"]  # no per-expert counts exchanged


def test_overlapped_dropless_reads_split_sizes_once_per_layer(matrix):
    """Pipelined in 3 chunks, dropless still reads its split sizes once per MoE layer and
    micro-batch (all chunks' in one read): the same host syncs as unchunked."""
    g, plain = matrix[0]["moe-ep-overlap"]["gpu"], matrix[0]["moe-ep"]["gpu"]
    assert len(g["in_layer"]) == len(plain["in_layer"]) == 1 and g["in_layer"][0].endswith("(tolist)")
    assert sum(g["syncs"].values()) == sum(plain["syncs"].values()), (g["syncs"], plain["syncs"])


class _Layer(torch.nn.Module):
    def forward(self, x):
        n = int(x.sum())  # a scalar read inside a layer
        torch.bincount(x.long().flatten(), minlength=4)
        y = x[x > 0]  # boolean-mask indexing
        host = torch.ones(x.shape[-1])  # made without device=: a host tensor on a GPU run
        return (x * host).sum() + n + y.numel()


def test_recorder_names_syncs_layers_and_host_tensors():
    """In-process: each kind of host sync is found inside the layer, and a host tensor mixed
    into a device computation is an error; a host scalar is not. (Places name meshfold
    frames; this test's layer is not one, so they read "torch (no meshfold frame)".)"""
    layer = _Layer()
    with FakeTensorMode(), gpucheck.recording(layer_modules=[layer]) as rec:
        x = torch.randn(4, 8)  # made before the step: a device tensor (the batch)
        with HostTensorMode():
            layer(x)
            x * torch.tensor(2.0)  # a host scalar: fine on CUDA
        syncs = rec.pop_step()["syncs"]
    kinds = {k.split(" (")[-1].rstrip(")") for k in syncs}
    assert kinds == {"scalar read", "bincount", "boolean-mask indexing"}, syncs
    assert len(rec.errors) == 1 and "host tensor torch.float32[8]" in rec.errors[0], rec.errors
    assert len(rec.in_layer) == 3, rec.in_layer


def test_rank_lists_are_real_under_the_recorder():
    """The mesh's rank table regrouped for ``dist.new_group`` (cp hybrid sub-groups, the
    outer low-communication group) inside the dry-run's fake mode and recorder: the real
    ranks, as tensor ops outside the fake mode give them (they once came back invented: [1, 1])."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=24)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _real_mesh_tensors(), gpucheck.recording():
            with unset_fake_temporarily():
                dims = build_mesh(ParallelConfig(pp=2, dp_shard=3, cp=2, tp=2), 1, "cpu")
            got = {d: dims.rank_lists(d) for d in ("pp", "dp_shard", "cp", "tp")}
        table = torch.arange(24).view(1, 2, 1, 3, 2, 2)  # init_device_mesh's row-major layout
        for d, lists in got.items():
            axis = dims.mesh.mesh_dim_names.index(d)
            assert lists == table.movedim(axis, -1).reshape(-1, table.shape[axis]).tolist(), d
    finally:
        dist.destroy_process_group()
