"""Hugging Face interop against the real ``transformers`` LlamaForCausalLM (random weights,
built from a config and saved locally; no network): imported logits equal HF's, exported
checkpoints load in transformers with equal logits, training starts from an import."""

import json

import pytest
import torch

from meshfold.cli import main
from meshfold.config import from_dict, load_config
from meshfold.convert import load_model, read_checkpoint_model
from meshfold.testing import tiny_config

transformers = pytest.importorskip("transformers")

# float64 on both sides, but transformers computes RMSNorm and the RoPE tables in float32:
# differences ~5e-8 on logits of std ~0.1. A wrong q/k permutation differs by ~3e-3.
TOL = dict(rtol=1e-6, atol=1e-6)


def _hf_model(tmp_path, tied: bool):
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=320, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tied, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # HF initialises norms to 1; make them random so a swap would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    folder = tmp_path / ("hf-tied" if tied else "hf")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_matches_transformers_logits(tmp_path, tied):
    hf, folder = _hf_model(tmp_path, tied)
    out = tmp_path / "imported"
    assert main(["convert", "import", str(folder), str(out)]) == 0
    ours = load_model(out, torch.float64).eval()
    tokens = torch.randint(0, 320, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, **TOL)
    assert "[model]" in (out / "config.toml").read_text()


def test_export_of_trained_checkpoint_loads_in_transformers(tmp_path):
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(tiny_config(str(tmp_path / "run"), train={"steps": 2, "checkpoint_every": 2})))
    tr.fit()
    out = tmp_path / "exported"
    assert main(["convert", "export", str(tmp_path / "run" / "checkpoints" / "step-2"), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float64,
                                                       attn_implementation="eager").eval()
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, tr.model(tokens), **TOL)


def test_export_shards_and_round_trips(tmp_path):
    hf, folder = _hf_model(tmp_path, tied=False)
    main(["convert", "import", str(folder), str(tmp_path / "imported")])
    out = tmp_path / "again"
    assert main(["convert", "export", str(tmp_path / "imported"), str(out), "--max-shard-gb", "0.0001"]) == 0
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    back = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float64).state_dict()
    for name, value in hf.state_dict().items():
        assert torch.equal(back[name], value), name


def test_training_starts_from_import(tmp_path):
    from meshfold.train.trainer import Trainer

    hf, folder = _hf_model(tmp_path, tied=False)
    imported = tmp_path / "imported"
    main(["convert", "import", str(folder), str(imported)])
    assert load_config(imported / "config.toml").train.run_dir == f"{imported}-train"  # its own, not runs/debug
    state, m = read_checkpoint_model(imported)
    cfg = tiny_config(str(tmp_path / "run"), train={"steps": 2, "init_from": str(imported)})
    cfg["model"].update(ffn_dim=m.ffn_dim, rope_theta=m.rope_theta, norm_eps=m.norm_eps)
    tr = Trainer(from_dict(cfg))
    tr.checkpointer.resume()
    for name, value in tr.full_state().items():
        assert torch.equal(value, state[name]), name
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(tr.model(tokens), hf(tokens).logits, **TOL)
    losses = tr.fit()
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_import_rejects_mismatched_model(tmp_path):
    from meshfold.train.checkpoint_files import CheckpointError
    from meshfold.train.trainer import Trainer

    _, folder = _hf_model(tmp_path, tied=False)
    imported = tmp_path / "imported"
    main(["convert", "import", str(folder), str(imported)])
    cfg = tiny_config(str(tmp_path / "run"), train={"steps": 1, "init_from": str(imported)})
    cfg["model"]["ffn_dim"] = 64
    with pytest.raises(CheckpointError, match=r"train.init_from: .*feed_forward.w1.weight has shape \(88, 32\) "
                                              r"in the checkpoint but \(64, 32\) in this model"):
        Trainer(from_dict(cfg)).checkpointer.resume()
