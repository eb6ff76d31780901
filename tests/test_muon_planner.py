"""``train.optimizer = "auto"``: the planner's search prices every optimizer kind and picks
the fastest layout that fits (planner/choices.py ``search_each``); Muon where its
smaller states let a faster layout fit, AdamW where memory is ample (Muon adds Newton-Schulz
and its exchange). ``meshfold plan --out`` writes the choice; ``meshfold train`` refuses
"auto" in one line."""

import tomllib

import pytest

from meshfold.errors import ConfigError
from meshfold.models.presets import preset
from meshfold.planner.cluster import cluster_from_dict
from meshfold.planner.search import search
from meshfold.planner.workload import Workload


def _cluster(gib: int):
    return cluster_from_dict({"nodes": 1, "devices_per_node": 2, "device": "h100-sxm", "memory_gib": gib,
                              "intra_node_GBps": 300, "inter_node_GBps": 25})


@pytest.mark.parametrize("gib,winner", [(24, "muon"), (16, "muon"), (80, "adamw")])
def test_search_picks_muon_where_memory_binds_and_adamw_where_it_does_not(gib, winner):
    # llama3.2-1b, 8 sequences, 2 devices: at 24 GiB both fit but Muon's states (one momentum)
    # let a faster layout fit; at 16 GiB only Muon fits; at 80 GiB the same layout fits either
    # way and AdamW's step is shorter.
    c = _cluster(gib)
    best = {kind: search(Workload(preset("llama3.2-1b"), 8, dtype="bf16-amp", optimizer=kind), c, top=2).ranked[0]
            for kind in ("adamw", "muon")}
    auto = search(Workload(preset("llama3.2-1b"), 8, dtype="bf16-amp", optimizer="auto"), c, top=3)
    chosen = auto.ranked[0]
    assert auto.any_fits and chosen.fits and chosen.optimizer == winner
    assert chosen.layout == best[winner].layout and chosen.step_time_s == best[winner].step_time_s
    loser = best["adamw" if winner == "muon" else "muon"]
    assert not loser.fits or loser.step_time_s > chosen.step_time_s
    assert any(f"auto: {winner}" in note for note in auto.notes)


def test_plan_out_writes_the_choice_and_train_refuses_auto(tmp_path, capsys):
    from meshfold.cli import main
    from meshfold.config import TrainConfig
    from meshfold.optim.registry import build_optimizer

    out = tmp_path / "plan.toml"
    main(["plan", "configs/debug.toml", "--cluster", "cpu:2", "--set", "train.optimizer=auto", "--out", str(out)])
    written = tomllib.loads(out.read_text())["train"]["optimizer"]
    assert written in ("adamw", "muon")
    assert f'optimizer = "{written}"' in capsys.readouterr().out
    with pytest.raises(ConfigError, match="train.optimizer = auto is the planner's to choose"):
        build_optimizer(None, TrainConfig(optimizer="auto"), None)
