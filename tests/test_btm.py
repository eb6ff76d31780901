"""Branch-Train-Merge (``meshfold btm``, docs/lowcomm.md): a seed checkpoint branched into two
domains (disjoint parts of the default corpus), each branch trained by the ordinary
trainer; the average round-trips through its checkpoint and ``convert export`` (every
tensor equals sum_i w_i theta_i, float64), the ensemble through its member checkpoints
(the mixture loss equals -log sum_j w_j p_j computed here, with weights the domain posterior),
and ``btm eval`` scores branches, merge and ensemble per domain."""

import json

import torch

from meshfold import btm
from meshfold.cli import main
from meshfold.convert import read_checkpoint_model, read_hf
from meshfold.testing import tiny_config, train_collect


def _toml(d: dict) -> str:
    import tomli_w

    return tomli_w.dumps(d)


def test_branch_train_merge_round_trips(tmp_path):
    cfg = tiny_config(str(tmp_path / "seed"), train={"steps": 2, "checkpoint_every": 2},
                      data={"max_docs": 40, "val_docs": 4})
    (tmp_path / "seed.toml").write_text(_toml(cfg))
    train_collect(cfg)
    seed = tmp_path / "seed" / "checkpoints" / "step-2"
    out = tmp_path / "btm"
    assert main(["btm", "branch", str(seed), "--domain", "a=default:0/2", "--domain", "b=default:1/2",
                 "--out", str(out), "--config", str(tmp_path / "seed.toml"), "--set", "train.steps=4",
                 "--set", "train.checkpoint_every=4"]) == 0
    for name in ("a", "b"):
        c = btm.load_config(out / name / "config.toml")
        assert c.train.init_from == str(seed.resolve()) and c.data.tokenizer == str((out / "tokenizer.json").resolve())
        train_collect(c.to_dict())
    ckpts = btm.branch_checkpoints(out)
    assert [p.name for p in ckpts.values()] == ["step-4", "step-4"]
    theta = {n: read_checkpoint_model(p)[0] for n, p in ckpts.items()}
    assert any(not torch.equal(theta["a"][k], theta["b"][k]) for k in theta["a"])  # the branches differ

    # weighted average -> checkpoint -> convert export -> the same tensors
    merged = tmp_path / "merged"
    assert main(["btm", "merge", str(out), "--out", str(merged), "--weights", "a=3", "--weights", "b=1"]) == 0
    hf = tmp_path / "hf"
    assert main(["convert", "export", str(merged), str(hf)]) == 0
    exported, _ = read_hf(hf)
    for name, value in read_checkpoint_model(merged)[0].items():
        want = 0.75 * theta["a"][name] + 0.25 * theta["b"][name]
        torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(exported[name].double(), want, rtol=1e-12, atol=1e-14)

    # ensemble -> member checkpoints (exportable) -> the mixture loss
    ens = tmp_path / "ens"
    assert main(["btm", "merge", str(out), "--out", str(ens), "--ensemble"]) == 0
    assert main(["convert", "export", str(ens / "members" / "b"), str(tmp_path / "hf_b")]) == 0
    members, prior, k = btm.load_ensemble(ens)
    assert prior == {"a": 0.5, "b": 0.5}
    for n in ("a", "b"):
        for name, value in members[n].state_dict().items():
            if name in theta[n]:
                assert torch.equal(value, theta[n][name])
    result = btm.evaluate(out, {"merged": str(merged)}, ens)
    assert set(result["val_loss"]) == {"branch a", "branch b", "merged", "ensemble"}
    c = btm.load_config(out / "a" / "config.toml")
    batches = btm.domain_batches(out, c, c.data.source)
    doc_mask = c.data.pack and c.data.doc_mask
    loss, w = btm.ensemble_loss(members, prior, batches, doc_mask, k)
    assert abs(sum(w.values()) - 1) < 1e-12 and loss == result["val_loss"]["ensemble"]["a"]
    # by hand: posterior from the first batch's sequences, then -log sum_j w_j p_j(token)
    with torch.no_grad():
        probs = {n: torch.softmax(members[n](batches[0]["inputs"], doc_ids=batches[0].get("doc_ids") if doc_mask
                                             else None).double(), -1) for n in members}
    labels = batches[0]["labels"]
    mask = labels != btm.IGNORE_INDEX
    tok = {n: probs[n].gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) for n in probs}
    seq = torch.stack([torch.where(mask, tok[n].log(), 0).sum(1) for n in ("a", "b")], 1)
    post = torch.softmax(seq + torch.tensor([0.5, 0.5]).log(), 1).mean(0)
    assert abs(post[0].item() - w["a"]) < 1e-9
    mix = -(post[0] * tok["a"] + post[1] * tok["b"]).log()[mask].sum().item()
    one = btm.ensemble_loss(members, prior, batches[:1], doc_mask, 1)[0]
    assert abs(one - mix / mask.sum().item()) < 1e-9
    assert json.loads((out / "btm_eval.json").read_text())["domains"] == ["a", "b"]


def test_branch_from_files_writes_every_domain(tmp_path, monkeypatch):
    """A ``--domain NAME=FILE`` branch gets its folder too (only ``default:K/N`` created one)
    and its source as an absolute path, so the branch trains from any working directory."""
    cfg = tiny_config(str(tmp_path / "seed"), train={"steps": 1, "checkpoint_every": 1},
                      data={"max_docs": 20, "val_docs": 2})
    (tmp_path / "seed.toml").write_text(_toml(cfg))
    train_collect(cfg)
    monkeypatch.chdir(tmp_path)
    for name in ("law", "code"):
        with open(f"{name}.jsonl", "w") as f:
            for i in range(8):
                f.write(json.dumps({"text": f"{name} document {i} " * 20}) + "\n")
    out = tmp_path / "btm"
    assert main(["btm", "branch", str(tmp_path / "seed" / "checkpoints" / "step-1"), "--domain", "law=law.jsonl",
                 "--domain", "code=code.jsonl", "--out", str(out), "--config", "seed.toml"]) == 0
    for name in ("law", "code"):
        c = btm.load_config(out / name / "config.toml")
        assert c.data.source == str((tmp_path / f"{name}.jsonl").resolve())
