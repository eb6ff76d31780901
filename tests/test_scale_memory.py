"""Meta-device build: a llama3-1b-shaped model (1.24e9 parameters, 4.9 GB in fp32) built
on 2 processes at ZeRO-3 never exists whole in any process. Each process's peak resident
memory (getrusage, lifetime of the worker) stays within its share of the parameters plus
1.5 GiB (torch itself, one unsharded parameter, the tokenised corpus)."""

from meshfold.testing import run_on, tiny_config

GIB = 2**30


def _build(cfg_dict: dict) -> dict:
    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    return trainer.build_report()


def test_llama3_1b_on_two_processes_zero3(tmp_path):
    cfg = tiny_config(str(tmp_path), parallel={"dp_shard": 2, "zero": 3},
                      train={"steps": 0, "dtype": "float32", "global_batch": 2})
    cfg["model"] = {"preset": "llama3-1b", "seq_len": 128}
    reports = run_on(2, _build, cfg)
    full = 1_235_814_400 * 4  # llama3-1b parameters (tied embeddings) x fp32
    print("llama3-1b, 2 processes, zero 3:", reports[0])
    for r in reports:
        assert abs(r["param_bytes_per_rank"] - full / 2) < 0.01 * full
        assert r["peak_rss_bytes"] <= full / 2 + 1.5 * GIB, r


def test_zero_steps_builds_reports_and_exits(tmp_path, capsys):
    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(tiny_config(str(tmp_path), train={"steps": 0})))
    assert trainer.fit() == []
    out = capsys.readouterr().out
    n = sum(p.numel() for p in trainer.model.parameters())
    assert f"params_per_rank {n}," in out and f"param_bytes_per_rank {n * 8}," in out
    assert not (tmp_path / "metrics.jsonl").exists()
