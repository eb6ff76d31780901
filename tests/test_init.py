"""Initial values: generated in tiles keyed by (seed, name, tile), so any box of a parameter
can be generated alone (models/llama.py: fill_initial_), and a model built on the meta
device and sharded any way holds exactly the one-process initial values
(parallel/materialize.py)."""

import pytest
import torch

from meshfold.models.config import ModelConfig
from meshfold.models.llama import fill_initial_, init_value
from meshfold.testing import run_on, tiny_config

CFG = ModelConfig(dim=32, n_layers=3, n_heads=4, vocab_size=320)


@pytest.mark.parametrize("shape", [(5000, 1500), (2100, 3000), (4, 300, 2500), (3000,), (7,), (1, 5000), (3, 1)])
def test_any_box_equals_the_slice_of_the_whole(shape):
    name = "layers.1.attention.wq.weight"
    full = init_value(name, shape, CFG, seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        off = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in shape)
        size = tuple(int(torch.randint(0, s - o + 1, (1,), generator=g)) for o, s in zip(off, shape))
        out = torch.empty(size, dtype=torch.float64)
        fill_initial_(out, name, shape, off, CFG, seed=3)
        assert torch.equal(out, full[tuple(slice(o, o + n) for o, n in zip(off, size))].double()), (off, size)


def test_values_depend_on_name_seed_and_scale():
    a = init_value("layers.0.attention.wq.weight", (64, 32), CFG, 0)
    assert not torch.equal(a, init_value("layers.0.attention.wk.weight", (64, 32), CFG, 0))
    assert not torch.equal(a, init_value("layers.0.attention.wq.weight", (64, 32), CFG, 1))
    assert torch.equal(a, init_value("layers.0.attention.wq.weight", (64, 32), CFG, 0))
    big = init_value("layers.0.feed_forward.w1.weight", (2048, 2048), CFG, 0)
    assert abs(big.std().item() - 0.02) < 2e-4 and abs(big.mean().item()) < 1e-4
    out = init_value("layers.0.feed_forward.w2.weight", (2048, 2048), CFG, 0)  # depth-scaled
    assert abs(out.std().item() - 0.02 / (2 * CFG.n_layers) ** 0.5) < 1e-4
    # Tiles are independent streams: no two tiles of one parameter repeat each other.
    assert not torch.equal(big[:1024, :1024], big[1024:, :1024])
    assert torch.equal(init_value("norm.weight", (32,), CFG, 0), torch.ones(32))
    assert torch.equal(init_value("output.bias", (32,), CFG, 0), torch.zeros(32))


def test_box_outside_the_parameter_is_refused():
    with pytest.raises(ValueError, match="not inside"):
        fill_initial_(torch.empty(4, 4), "w.weight", (8, 8), (6, 0), CFG, 0)


def _initial_state(cfg_dict: dict) -> dict | None:
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))  # train.steps = 0: built, nothing trained
    state = trainer.full_state()
    return state if not dist.is_initialized() or dist.get_rank() == 0 else None


@pytest.mark.parametrize("world,parallel,model", [
    pytest.param(4, {"dp_shard": 2, "tp": 2, "zero": 3}, {}, id="tp2xfsdp2-strided"),
    pytest.param(4, {"dp_shard": 1, "pp": 2, "tp": 2}, {}, id="pp2xtp2"),
    pytest.param(4, {"dp_shard": 2, "tp": 2, "ep": 2}, {"moe_experts": 4, "moe_topk": 2}, id="moe-ep2xtp2"),
    # 1 local expert over edp = 2 ranks: FSDP2 shards the experts' dim 1 (parallel/facts/sizes.py)
    pytest.param(4, {"dp_shard": 4, "ep": 2}, {"moe_experts": 2, "moe_topk": 2}, id="moe-ep2-experts-dim1"),
])
def test_sharded_build_holds_the_one_process_values(tmp_path, world, parallel, model):
    """Every parameter gathered from the sharded build equals the one-process value
    bit for bit (both float64 from the same float32 draws)."""
    def cfg(parallel_section):
        return tiny_config(str(tmp_path), parallel=parallel_section, model=model,
                           train={"steps": 0, "global_batch": 4})
    ref = _initial_state(cfg({"dp_shard": 1}))
    got = run_on(world, _initial_state, cfg(parallel))[0]
    assert set(got) == set(ref)
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


def test_large_model_build_reports_progress_on_stderr(capsys):
    """Above the threshold rank 0 says how far the fill is, one line per tenth, ending at
    100 %; below it (every small run) the build is silent. The threshold is an argument."""
    from meshfold.models.llama import Transformer
    from meshfold.parallel.materialize import build_on_meta, materialize

    def build(progress_above):
        model = build_on_meta(lambda: Transformer(CFG), torch.float32)
        return materialize(model, CFG, 0, torch.device("cpu"), progress_above=progress_above)

    build(progress_above=10**9)
    assert capsys.readouterr().err == ""
    total = sum(p.numel() for p in build(progress_above=0).parameters())
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith(f"meshfold: materialising {total / 1e9:.2f} B parameters: ")
                         for line in lines)
    percents = [int(line.split(": ")[2].split(" %")[0]) for line in lines]
    assert percents == sorted(set(percents)) and percents[-1] == 100 and len(percents) <= 10
