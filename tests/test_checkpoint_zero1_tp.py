"""Checkpoints of ZeRO-1 under tensor parallel (``ShardedAdamW``, Megatron's distributed
optimizer): each rank writes only the boxes of Adam state its flat segment covers, under
the same names and global shapes as every other layout, so they resume bit for bit and
reshard into any layout. float64, one-process references computed here."""

import shutil

import pytest
import torch

from meshfold.config import from_dict
from meshfold.testing import run_on, tiny_config, train_chain, train_segment
from meshfold.train.checkpoint_files import read_dcp_metadata
from meshfold.optim.zero_state import flat_boxes

STEPS, SPLIT = 4, 2
TP_ZERO1 = {"tp": 2, "dp_shard": 2, "zero": 1}


def state_at(cfg_dict: dict) -> dict:
    """One process: resume from the run directory and return the step it resumed at, the
    parameters, and the Adam moments and steps by their checkpoint names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    start = tr.checkpointer.resume()
    tr.checkpointer.close()
    tr.fault.close()
    optim = get_state_dict(tr.model, tr.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))[1]
    return {"start": start, "params": tr.full_state(),
            "moments": {k: v.clone() for k, v in optim.items() if k.endswith(("exp_avg", "exp_avg_sq"))},
            "steps": {k: float(v) for k, v in optim.items() if k.endswith(".step")}}


def _cfg(run_dir, parallel=None, model=None, **train):
    return tiny_config(str(run_dir), parallel=parallel or {"dp_shard": -1}, model=model or {},
                       train={"steps": STEPS, **train})


def _tp_cfg(run_dir, **train):
    # checkpoint_every > 0: tp with zero 1 is no longer refused (the run also saves by itself).
    return _cfg(run_dir, TP_ZERO1, checkpoint_every=SPLIT, **train)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, STEPS steps straight, no checkpoints."""
    return train_segment(_cfg(tmp_path_factory.mktemp("ref")), STEPS, save=False)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """tp 2 x dp_shard 2, ZeRO-1: STEPS steps straight."""
    return run_on(4, train_segment, _tp_cfg(tmp_path_factory.mktemp("straight")), STEPS, save=False)[0]


@pytest.fixture(scope="module")
def tp_saved(tmp_path_factory):
    """tp 2 x dp_shard 2, ZeRO-1: SPLIT steps, checkpointed (a run directory to copy)."""
    run_dir = tmp_path_factory.mktemp("tp_saved")
    return run_dir, run_on(4, train_segment, _tp_cfg(run_dir), SPLIT)[0]


def test_flat_boxes_cover_exactly_the_flat_range():
    # Every flat range of 1-, 2-, 3- and 4-D tensors: boxes in order, contiguous, and the
    # tensor cut by each box is the flat range it claims (3-D: MoE expert weights).
    for shape in [(7,), (3, 5), (2, 3, 4), (2, 2, 3, 2)]:
        t = torch.arange(torch.Size(shape).numel()).view(shape)
        n = t.numel()
        for a in range(n):
            for b in range(a + 1, n + 1):
                boxes = flat_boxes(shape, a, b)
                assert len(boxes) <= 2 * len(shape) - 1
                assert [x[2] for x in boxes] == [a] + [x[3] for x in boxes[:-1]] and boxes[-1][3] == b
                for off, size, lo, hi in boxes:
                    block = t[tuple(slice(o, o + z) for o, z in zip(off, size))]
                    assert torch.equal(block.reshape(-1), t.view(-1)[lo:hi]), (shape, a, b, off, size)


def test_each_rank_writes_only_its_boxes(tp_saved):
    # The Adam state is saved under the usual names and global shapes, as several chunks
    # (boxes of the ranks' flat segments) that tile each tensor exactly once.
    run_dir, _ = tp_saved
    meta = read_dcp_metadata(run_dir / "checkpoints" / f"step-{SPLIT}").state_dict_metadata
    model = {k[len("model."):]: m for k, m in meta.items() if k.startswith("model.")}
    split = 0
    for name, m in model.items():
        for k in ("exp_avg", "exp_avg_sq"):
            got = meta[f"optim.state.{name}.{k}"]
            assert tuple(got.size) == tuple(m.size), name
            covered = torch.zeros(tuple(m.size), dtype=torch.int32)
            for c in got.chunks:
                covered[tuple(slice(o, o + z) for o, z in zip(c.offsets, c.sizes))] += 1
            assert bool((covered == 1).all()), f"{name}.{k}: not tiled exactly once"
            split += len(got.chunks) > 2  # more boxes than tp pieces: cut by the dp segments
    assert split > 0
    # Every rank's file holds about its quarter of the moments (none gathered them all), and
    # all together hold them once (a box written with its whole base storage would not be):
    # measured 201-220 kB per rank of 835 kB, for 699 kB of float64 values.
    per_file: dict[str, int] = {}
    for idx, info in read_dcp_metadata(run_dir / "checkpoints" / f"step-{SPLIT}").storage_data.items():
        if idx.fqn.startswith("optim.state.") and idx.fqn.endswith(("exp_avg", "exp_avg_sq")):
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    values = 2 * 8 * sum(m.size.numel() for m in model.values())
    assert len(per_file) == 4 and max(per_file.values()) < 0.4 * sum(per_file.values()), per_file
    assert values <= sum(per_file.values()) < 1.5 * values, (per_file, values)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_tp_zero1_resume_is_bitwise(straight, tp_saved, tmp_path, async_save):
    # SPLIT steps, checkpoint, resume, the rest == STEPS steps straight, bit for bit
    # (the same layout, so the same reduction order).
    if async_save:
        first = run_on(4, train_segment, _tp_cfg(tmp_path, async_checkpoint=True), SPLIT)[0]
    else:
        shutil.copytree(tp_saved[0], tmp_path, dirs_exist_ok=True)
        first = tp_saved[1]
    second = run_on(4, train_segment, _tp_cfg(tmp_path), STEPS, save=False)[0]
    assert second["start"] == SPLIT
    assert first["losses"] + second["losses"] == straight["losses"]
    for name, value in straight["params"].items():
        assert torch.equal(second["params"][name], value), name


LOADS_INTO_ONE_PROCESS = {  # id: (world, [parallel], [model] updates)
    "tp2xdp2": (4, TP_ZERO1, {}),
    # each stage's ranks cut their own parameters into segments; a stage saves only its layers
    "pp2xtp2xdp2": (8, {"tp": 2, "pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 2}, {}),
    # dp_replicate replicas write identical boxes, which DCP keeps once
    "tp2xdp_replicate2xdp_shard2": (8, {"tp": 2, "dp_replicate": 2, "dp_shard": 2, "zero": 1}, {}),
    # MoE: 3-D expert weights (experts x rows x columns); with one layer a dp segment ends
    # inside an expert weight, cut into partial rows of partial matrices (asserted below)
    "moe-tp2xdp2": (4, TP_ZERO1, {"moe_experts": 4, "moe_topk": 2, "n_layers": 1}),
}


@pytest.mark.parametrize("layout", list(LOADS_INTO_ONE_PROCESS))
def test_zero1_checkpoint_loads_into_one_process(tmp_path, layout):
    # ShardedAdamW under tp 2 x dp_shard 2, pp 2 x tp 2 x dp_shard 2, and with MoE blocks.
    # Loaded by one process, the checkpoint holds the parameters and Adam moments the
    # one-process run has at that step (read back from its own checkpoint, which the
    # one-process resume test shows to be exact), to float64 rounding (tp and the data-parallel
    # average reduce in other orders). Parameters: rtol 1e-9, atol 1e-12; moments (from
    # ~1e-15 to ~1e-2): rtol 1e-8 elementwise, atol 1e-12 x the tensor's largest magnitude
    # (an element that is a near-cancelling sum carries the rounding of its largest terms:
    # measured 1.7e-17 absolute, 2.9e-8 relative, on an exp_avg element of 6e-10).
    # Measured on the 2-core VM: largest elementwise relative difference 5e-11 (parameters),
    # 2e-10 (moments) elsewhere.
    world, parallel, model = LOADS_INTO_ONE_PROCESS[layout]
    train_segment(_cfg(tmp_path / "one", model=model), SPLIT)  # its own state, through its own checkpoint (exact here)
    own = state_at(_cfg(tmp_path / "one", model=model))
    run_on(world, train_segment, _cfg(tmp_path / "loaded", parallel, model), SPLIT)
    if "moe_experts" in model:
        meta = read_dcp_metadata(tmp_path / "loaded" / "checkpoints" / f"step-{SPLIT}").state_dict_metadata
        cut = {}  # a dp segment ends inside one expert weight: partial rows of a partial matrix
        for w in ("w13", "w2"):
            t = meta[f"optim.state.layers.0.feed_forward.experts.{w}.exp_avg"]
            cut[w] = [tuple(c.sizes) for c in t.chunks
                      if c.sizes[0] == 1 and c.sizes[1] == 1 and c.sizes[2] < t.size[2]]
        assert any(cut.values()), cut
    loaded = state_at(_cfg(tmp_path / "loaded", model=model))
    assert own["start"] == loaded["start"] == SPLIT
    assert loaded["steps"] == own["steps"] and set(own["steps"].values()) == {float(SPLIT)}
    assert set(loaded["moments"]) == set(own["moments"]) and own["moments"]
    for name, value in own["params"].items():
        torch.testing.assert_close(loaded["params"][name], value, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for name, value in own["moments"].items():
        assert not torch.equal(value, torch.zeros_like(value)), name
        scale = value.abs().max().item()  # reordered float64 sums err relative to the largest terms
        torch.testing.assert_close(loaded["moments"][name], value, rtol=1e-8, atol=1e-12 * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")


RESHARD_CHAIN = [  # (world, [parallel], stop step): every segment resumes the previous one's checkpoint
    (1, {"dp_shard": -1}, 1),  # one process
    (4, TP_ZERO1, 2),  # tp 2 x dp_shard 2, ZeRO-1: reads the one-process tensors into its boxes
    (8, {"tp": 2, "dp_shard": 4, "zero": 1}, 3),  # tp 2 x dp_shard 4, ZeRO-1: other segments, other boxes
    (4, {"dp_shard": 4, "zero": 3}, STEPS),  # FSDP2 ZeRO-3: reads the boxes into its shards
]


def test_reshard_through_tp_zero1(reference, tmp_path):
    # One process -> tp 2 x dp_shard 2 ZeRO-1 -> tp 2 x dp_shard 4 ZeRO-1 -> FSDP2 ZeRO-3:
    # every step's loss and the final parameters equal the one-process run that never
    # stopped, to float64 rounding: rtol 1e-9, atol 1e-11.
    starts, losses, params = train_chain(RESHARD_CHAIN, lambda _, parallel: _cfg(tmp_path, parallel))
    assert starts == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-9, atol=1e-11)
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")
