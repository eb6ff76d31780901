"""Multi-token prediction (models/deepseek/mtp.py): the loss against a hand-written reference of
DeepSeek-V3's formula (each depth run on the sequence truncated by k, as the paper writes
it), float64; pipeline parallel against one process (losses, parameters, gradients:
rtol 1e-9, atol 1e-11); the metric; config errors."""

import json

import pytest
import torch
import torch.nn.functional as F

from meshfold.config import ConfigError, from_dict, validate
from meshfold.models.config import ModelConfig
from meshfold.models.llama import Transformer, init_weights
from meshfold.parallel.loss import MTPLoss, cross_entropy_sum
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_chain, train_collect

MTP = {"n_layers": 4, "mtp_depth": 2, "mtp_loss_weight": 0.5}


def _reference_loss(model: Transformer, tokens, labels, depth: int, weight: float):
    """main + weight / D * sum_k CE_k with depth k on positions 0..S-k-1 only (no padding):
    h'_k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})]), h_k = norm_k(Block_k(h'_k))."""
    S = tokens.shape[1]
    cos, sin = model.rope_cos[:S].unsqueeze(0), model.rope_sin[:S].unsqueeze(0)
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, (cos, sin))
    h = model.norm(h)
    main = F.cross_entropy(model.output(h).flatten(0, 1), labels.flatten(), reduction="sum")
    emb, extra = model.tok_embeddings(tokens), 0.0
    for k in range(1, depth + 1):
        mod, n = model.mtp[str(k - 1)], S - k
        x = mod.eh_proj(torch.cat([mod.enorm(emb[:, k:]), mod.hnorm(h[:, :n])], dim=-1))
        h = mod.norm(mod.block(x, (cos[:, :n], sin[:, :n])))
        extra = extra + F.cross_entropy(model.output(h).flatten(0, 1), labels[:, k:].flatten(), reduction="sum")
    return main, main + weight / depth * extra


def test_mtp_loss_equals_the_papers_formula():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=12, mtp_depth=2, mtp_loss_weight=0.3)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    init_weights(model, cfg, seed=3)
    tokens = torch.randint(0, 64, (2, 12))
    labels = torch.randint(0, 64, (2, 12))
    loss_fn = MTPLoss(cross_entropy_sum, 2, 0.3)
    got = loss_fn(model(tokens), labels)
    grads = torch.autograd.grad(got, list(model.parameters()))
    main, total = _reference_loss(model, tokens, labels, 2, 0.3)
    ref = torch.autograd.grad(total, list(model.parameters()))
    torch.testing.assert_close(got, main, rtol=0, atol=0)  # the reported value is the main loss
    for (name, _), g, r in zip(model.named_parameters(), grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert any(n.startswith("mtp.1.eh_proj") for n, _ in model.named_parameters())
    # the metric: the depths' unweighted sum, detached
    _, extra = _reference_loss(model, tokens, labels, 2, 1.0)
    torch.testing.assert_close(loss_fn.pop(), (extra - main) * 2, rtol=1e-12, atol=1e-12)
    model.eval()  # evaluation runs the main model only
    assert isinstance(model(tokens), torch.Tensor)


def test_mtp_targets_stay_in_their_document():
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32, seq_len=8, mtp_depth=1)
    model = Transformer(cfg).double()
    init_weights(model, cfg, seed=1)
    tokens = torch.randint(0, 32, (1, 8))
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    out = model(tokens, doc_ids=doc_ids)
    # position i has a depth-1 target only if token i+1 is in its document
    assert out.valid[0].tolist() == [[True, True, False, True, True, True, False, False]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref")
    ref = train_collect(tiny_config(str(path), model=MTP, train={"steps": 3}))
    ref["mtp_loss"] = [json.loads(x)["mtp_loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]
    assert any(n.startswith("mtp.") for n in ref["grads"]) and 2.0 < ref["mtp_loss"][0] < 10.0
    return ref


@pytest.mark.parametrize("world,parallel", [
    pytest.param(2, {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}, id="pp2-1f1b"),  # embedding on two ranks
    pytest.param(2, {"pp": 2, "pp_schedule": "zbv", "pp_microbatches": 2}, id="pp2-zbv"),  # both on rank 0
    pytest.param(2, {"tp": 2}, id="tp2"),  # depths' logits vocabulary-parallel
    pytest.param(4, {"pp": 2, "dp_shard": 2, "zero": 3, "pp_microbatches": 2}, id="pp2-fsdp2"),  # sharded copies
])
def test_mtp_layouts_match_one_process(world, parallel, reference, tmp_path):
    cfg = tiny_config(str(tmp_path), model=MTP, train={"steps": 3}, parallel=parallel)
    got = run_on(world, train_collect, cfg)[0]
    assert_runs_match(reference, got)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["mtp_loss"] for r in lines] == pytest.approx(reference["mtp_loss"], rel=1e-9)


def test_recompute_covers_the_depths(reference, tmp_path):
    got = train_collect(tiny_config(str(tmp_path), model=MTP, train={"steps": 3, "recompute": "full"}))
    assert_runs_match(reference, got)


def test_pp2_checkpoint_resumes_in_one_process(reference, tmp_path):
    # the embedding saved from both pp stages (equal copies) loads into one process's one weight
    starts, losses, params = train_chain(
        [(2, {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 2}, 2), (1, {}, 3)],
        lambda _, parallel: tiny_config(str(tmp_path), model=MTP, train={"steps": 3}, parallel=parallel))
    assert starts == [0, 2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-9, atol=1e-11)
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def test_mtp_config_errors(tmp_path):
    for model, parallel, needle in [
        ({"mtp_depth": -1}, {}, "model.mtp_depth must be >= 0"),
        ({"mtp_depth": 15}, {}, "below seq_len - 1"),
        ({"mtp_depth": 1, "mtp_loss_weight": -1.0}, {}, "mtp_loss_weight"),
        ({"mtp_depth": 1}, {"cp": 2}, "parallel.cp"),
        ({"mtp_depth": 1}, {"tp": 2, "sp": True}, "parallel.sp"),
    ]:
        cfg = from_dict(tiny_config(str(tmp_path), model=model, parallel=parallel))
        with pytest.raises(ConfigError, match=needle):
            validate(cfg, 2 if parallel else 1)


def test_counts_include_the_depths():
    import dataclasses

    from meshfold.models.counts import flops_per_token, param_count
    from meshfold.models.presets import preset
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=12, mtp_depth=2, moe_experts=4,
                      moe_first_dense=1)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    plain = dataclasses.replace(cfg, mtp_depth=0)
    assert flops_per_token(cfg, training=False) == flops_per_token(plain, training=False)  # inference: main only
    assert flops_per_token(cfg) > flops_per_token(plain)
    # DeepSeek-V3's published 671B excludes its MTP module; with it (embedding and head shared,
    # not copied as in the Hugging Face files' 685B) the model holds 682.6B
    v3 = preset("deepseek-v3")
    assert v3.mtp_depth == 0 and round(param_count(v3) / 1e9) == 671
    assert round(param_count(dataclasses.replace(v3, mtp_depth=1)) / 1e9, 1) == 682.6


def test_deepseek_v3_mtp_layers_import_and_export(tmp_path):
    from meshfold.convert import read_hf
    from meshfold.models.hf import hf_config_from_model, to_hf, write_safetensors

    m = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=16, moe_experts=4, moe_topk=2,
                    moe_ffn_dim=16, moe_shared_experts=1, moe_first_dense=1, moe_router="sigmoid",
                    moe_bias_balance=True, mla_kv_rank=16, mla_q_rank=24, mla_rope_dim=8, mla_nope_dim=8,
                    mla_v_dim=12, mtp_depth=1)
    model = Transformer(m)
    init_weights(model, m, seed=0)
    state = model.state_dict()
    hf = to_hf(state, m)
    # DeepSeek-V3's layout: module 1 is decoder layer n_layers, with its own embedding/head copies
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.3.down_proj.weight", "mlp.gate.weight"):
        assert f"model.layers.2.{name}" in hf, name
    assert torch.equal(hf["model.layers.2.shared_head.head.weight"], state["output.weight"])
    assert torch.equal(hf["model.layers.2.embed_tokens.weight"], state["tok_embeddings.weight"])
    for keep_mtp in (True, False):
        folder = tmp_path / str(keep_mtp)
        files = hf if keep_mtp else {k: v for k, v in hf.items() if not k.startswith("model.layers.2.")}
        folder.mkdir()
        write_safetensors(files, folder, 1 << 30)
        (folder / "config.json").write_text(json.dumps(hf_config_from_model(m, torch.float32)))
        got, gm = read_hf(folder)
        assert gm.mtp_depth == (1 if keep_mtp else 0)
        want = {k: v for k, v in state.items() if keep_mtp or not k.startswith("mtp.")}
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=lambda msg, k=k: f"{k}: {msg}")
    # a module head that is not the main one cannot be shared
    bad = dict(hf, **{"model.layers.2.shared_head.head.weight": hf["lm_head.weight"] + 1})
    (tmp_path / "bad").mkdir()
    write_safetensors(bad, tmp_path / "bad", 1 << 30)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(hf_config_from_model(m, torch.float32)))
    with pytest.raises(ConfigError, match="differs from the main model's output head"):
        read_hf(tmp_path / "bad")
