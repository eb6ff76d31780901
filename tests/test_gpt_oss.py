"""gpt-oss (``gpt_oss``, ``meshfold/models/gpt_oss/``) against transformers' GptOssForCausalLM on
a random tiny model (4 layers: windowed, full, windowed, full; a 5-token window on 24-64
tokens; sinks drawn large enough to matter; the SwiGLU clamp low enough to bite; YaRN RoPE
without truncation): ``convert check`` <= 1e-4, import gives transformers' logits and each
feature matters, export round-trips every tensor bit for bit, MXFP4 experts dequantise as
transformers does; the presets' parameter counts equal transformers'; windows + sinks +
packed documents train under tp 2 + sp x FSDP 2, pp 2 (zbv) x FSDP 2 and ep 2 x FSDP 4
exactly as in one process (float64); context parallel refuses sinks in one line."""

import dataclasses
import json

import pytest
import torch

from meshfold.cli import main
from meshfold.config import ConfigError, from_dict, validate
from meshfold.convert import load_model, read_checkpoint_model
from meshfold.models.config import ModelConfig
from meshfold.models.counts import param_count
from meshfold.models.gpt_oss.hf import dequantize_mxfp4
from meshfold.models.llama import Transformer, rope_frequencies
from meshfold.models.presets import PRESETS
from meshfold.testing import assert_runs_match, run_on, save_random_hf_model, tiny_config, train_collect

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WINDOW, LIMIT = 320, 24, 5, 0.6
# float64 weights both sides, but transformers' gpt-oss RMSNorm normalises in float32 and its
# RoPE tables are float32 whatever the dtype: ~4e-8 on these logits. A missed window, sink,
# clamp or RoPE rule differs by 1e-3 or more (asserted below).
TOL = dict(rtol=1e-5, atol=1e-6)
HF = dict(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-5,
          sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=LIMIT,
          attn_implementation="eager", experts_implementation="eager",
          rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                           "original_max_position_embeddings": 4096, "rope_theta": 1e4})
# a gpt-oss shape as meshfold [model] keys (for training): windows, sinks, biases, clamped experts
MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, attn_head_dim=8, ffn_dim=16, vocab_size=VOCAB, seq_len=32,
             bias=True, alternating_window=WINDOW, attention_sinks=True, mlp="clamped_swiglu", swiglu_limit=LIMIT,
             moe_experts=4, moe_topk=2, moe_bias=True, rope_scaling="yarn", rope_factor=8.0,
             rope_original_seq_len=32, rope_truncate=False, moe_aux_loss_coef=0.0)


def hf_model(folder, dtype=torch.float64):
    model = save_random_hf_model(folder, transformers.GptOssConfig(**HF), dtype)
    with torch.no_grad():  # transformers draws sinks at std 0.02, where a dropped sink would not show
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1)
    model.save_pretrained(folder)
    return model


def test_convert_check_json(tmp_path, capsys):
    hf_model(tmp_path / "hf", torch.float32)
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_type"] == "gpt_oss" and result["tokens"][1] > WINDOW
    assert 0 <= result["max_abs_diff"] <= 1e-4 and result["ok"] is True


def test_import_then_export_matches_transformers(tmp_path):
    hf = hf_model(tmp_path / "hf")
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    _, m = read_checkpoint_model(tmp_path / "ours")
    assert (m.alternating_window, m.attention_sinks, m.mlp, m.moe_bias, m.rope_truncate) == (
        WINDOW, True, "clamped_swiglu", True, False)
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
        # the window, the sinks and the clamp all matter at this size
        for change in (dict(alternating_window=0), dict(attention_sinks=False), dict(swiglu_limit=100.0)):
            other = Transformer(dataclasses.replace(m, **change)).double().eval()
            other.load_state_dict(ours.state_dict(), strict=False)
            assert (other(x) - want).abs().max() > 1e-3, change
    # YaRN without truncation (gpt-oss's): transformers' frequencies, not the truncated ones
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, scale = ROPE_INIT_FUNCTIONS["yarn"](hf.config)
    for truncate, differs in ((False, False), (True, True)):
        mine, my_scale = rope_frequencies(dataclasses.replace(m, rope_truncate=truncate))
        assert my_scale == pytest.approx(scale)
        assert ((mine - theirs.double()).abs().max() > 1e-3) == differs
    torch.testing.assert_close(rope_frequencies(m)[0], theirs.double(), rtol=1e-6, atol=0)
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["layer_types"] == hf.config.layer_types
    assert config["rope_parameters"]["truncate"] is False
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                             experts_implementation="eager").eval()
    theirs = back.state_dict()
    assert set(theirs) == set(hf.state_dict())
    for name, value in hf.state_dict().items():
        assert torch.equal(theirs[name], value), name
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, rtol=0, atol=0)


def test_mxfp4_experts_dequantise_as_transformers_does(tmp_path, capsys):
    """Published checkpoints hold the experts as MXFP4 blocks and scales: meshfold's import
    equals transformers' own dequantisation, value for value, and the logits its model gives."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(115, 135, (3, 10, 2), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))

    hf_model(tmp_path / "hf", torch.float32)
    state = load_file(tmp_path / "hf" / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = state.pop(name).shape
        state[name + "_blocks"] = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=g,
                                                dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(118, 128, (experts, rows_out, rows_in // 32), generator=g,
                                                dtype=torch.uint8)
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0  # transformers' MXFP4 loader, dequantising
    assert json.loads(capsys.readouterr().out)["max_abs_diff"] <= 1e-4
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = load_model(tmp_path / "ours", torch.float32).eval()
    dequant = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    with torch.no_grad():
        assert (ours(x) - dequant(x).logits).abs().max() <= 1e-4
    # exported as plain tensors (no quantization_config): transformers reads the same model back
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back"), "--dtype", "bfloat16"]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    torch.testing.assert_close(back["model.layers.1.mlp.experts.down_proj"].float(),
                               dequant.model.layers[1].mlp.experts.down_proj.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_preset_counts_equal_transformers(preset):
    m = ModelConfig(**PRESETS[preset])
    hf = dict(hidden_size=m.dim, intermediate_size=m.expert_dim, num_attention_heads=m.n_heads,
              num_key_value_heads=m.kv_heads, head_dim=m.head_dim, num_hidden_layers=m.n_layers,
              vocab_size=m.vocab_size, num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_topk)
    with torch.device("meta"):
        theirs = transformers.GptOssForCausalLM(transformers.GptOssConfig(**hf))
        ours = Transformer(m)
    want = sum(p.numel() for p in theirs.parameters())
    assert param_count(m) == sum(p.numel() for p in ours.parameters()) == want


def _layouts(cfgs: list[dict]) -> list:
    """Every layout's run in one process group (one spawn for all of them)."""
    return [train_collect(cfg) for cfg in cfgs]


def short_docs(folder) -> dict:
    """``[data]`` of a corpus of 2-12 word documents: every 32-token row packs several, so the
    document masks cut the windows (the default corpus's documents fill whole rows)."""
    import random

    rng = random.Random(5)
    words = "the sink takes what no key wants while windows slide over the packed documents".split()
    path = folder / "short.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))})
                            + "\n" for _ in range(300)))
    return {"source": str(path), "max_docs": 0, "cache_dir": str(folder / "cache")}


def test_windows_sinks_documents_train_in_every_layout_as_one_process(tmp_path):
    """Packed documents (data.pack with document masks, the default; several per row) through
    windowed and full layers with sinks, biased clamped experts: losses of 5 steps, every
    parameter and gradient equal one process's in float64. (The balance loss is off: it counts
    over a step's micro-batches, pp's two against one process's one; tests/test_moe.py.)"""
    data = short_docs(tmp_path)

    def cfg(name, **parallel):
        return tiny_config(str(tmp_path / name), model=MODEL, parallel=parallel, train={"steps": 5}, data=data)

    ref = train_collect(cfg("one"))
    assert len(ref["losses"]) == 5
    assert {"layers.0.attention.sinks", "layers.1.feed_forward.experts.w13_bias",
            "layers.2.feed_forward.router.bias"} <= set(ref["grads"])
    layouts = [cfg("tp2sp_fsdp2", tp=2, sp=True, dp_shard=2),
               cfg("pp2zbv_fsdp2", pp=2, pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=2, dp_shard=2),
               cfg("ep2_fsdp4", ep=2, dp_shard=4)]
    for name, got in zip(("tp2sp_fsdp2", "pp2zbv_fsdp2", "ep2_fsdp4"), run_on(4, _layouts, layouts)[0]):
        try:
            assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_context_parallel_runtime_trains_windows_and_sinks_as_one_process(tmp_path):
    """The cp attention the swap installs (ring: tile pairs outside the window skipped; Ulysses)
    trains the gpt-oss shape on packed documents as one process does: 5 steps, every loss,
    parameter and gradient (float64), cp 2 ring (balanced) and cp 2 Ulysses, each x FSDP 2."""
    data = short_docs(tmp_path)

    def cfg(name, **parallel):
        return tiny_config(str(tmp_path / name), model=MODEL, parallel=parallel, train={"steps": 5}, data=data)

    ref = train_collect(cfg("one"))
    layouts = [cfg("cp2ring_fsdp2", cp=2, cp_mode="ring", dp_shard=2),
               cfg("cp2ulysses_fsdp2", cp=2, cp_mode="ulysses", dp_shard=2)]
    for name, got in zip(("cp2ring_fsdp2", "cp2ulysses_fsdp2"), run_on(4, _layouts, layouts)[0]):
        try:
            assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_clamped_experts_only_in_moe_layers(tmp_path):
    cfg = from_dict(tiny_config(str(tmp_path), model={**MODEL, "moe_first_dense": 1}))
    with pytest.raises(ConfigError, match="routed experts only"):
        validate(cfg)


def test_cuda_dry_run_runs_windows_in_flash_attention(tmp_path):
    """``meshfold dry-run --device cuda`` (fake CUDA, bf16) of a gpt-oss shape at seq 512 with a
    128-token window under tp 2 + sp x FSDP 2: the windowed layers run flash attention's own
    window (no mask, no math kernel), over packed documents' runs and over plain rows, the
    full layers flash varlen / flash; no errors."""
    from meshfold.dryrun import dry_run_many

    model = dict(MODEL, dim=64, attn_head_dim=16, seq_len=512, alternating_window=128)
    cases = [(from_dict(tiny_config(str(tmp_path / name), model=model, data=data,
                                    parallel={"tp": 2, "sp": True, "dp_shard": 2},
                                    train={"dtype": "auto", "global_batch": 4})), 4)
             for name, data in (("documents", {}), ("rows", {"doc_mask": False}))]
    documents, rows = (report["gpu"] for report in dry_run_many(cases, device="cuda"))
    assert documents["errors"] == [] and rows["errors"] == []
    assert documents["attention"] == {"flash-window": 2, "flash-varlen": 2}
    assert rows["attention"].get("flash-window") == 2 and "math" not in rows["attention"]


def test_biased_experts_equal_on_every_kernel(monkeypatch):
    """The experts' biases on each kernel's row layout (``_Groups.row_experts``): the grouped
    GEMM (rows padded to aligned groups), the padded batched matmul and capacity's fixed slots
    all equal a per-expert loop, forward and gradients (float32). The grouped GEMM leaves the
    rows past its last group unwritten, forward and backward: they must not reach a bias
    gradient (0 and 1e3 there in this test, where uninitialised memory would hold anything)."""
    from meshfold.models.gpt_oss.activation import clamped_swiglu
    from meshfold.models import moe_experts
    from meshfold.models.moe_experts import GroupedExperts, fixed_groups

    torch.manual_seed(0)
    E, D, F, counts = 3, 8, 12, torch.tensor([5, 0, 7])
    experts = GroupedExperts(E, D, F, "clamped_swiglu", bias=True, glu=clamped_swiglu(ModelConfig(**MODEL)))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x, gates = torch.randn(int(counts.sum()), D), torch.rand(int(counts.sum()))
    owner = torch.repeat_interleave(torch.arange(E), counts)

    def loop():
        rows = []
        for i, e in enumerate(owner.tolist()):
            h = experts.w13[e] @ x[i] + experts.w13_bias[e]
            h = experts.glu(h[:F], h[F:])
            rows.append(gates[i] * (experts.w2[e] @ h + experts.w2_bias[e]))
        return torch.stack(rows)

    def grads(out):
        return [out.detach()] + list(torch.autograd.grad(out.square().sum(), list(experts.parameters())))

    want = grads(loop())
    real = moe_experts._GROUPED_MM

    class Unwritten(torch.autograd.Function):
        """The grouped GEMM with its unwritten rows (past the last offset) holding 0 forward and
        1e3 backward, as uninitialised memory may."""

        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            out = real(a, b, offs=offs)
            out[int(offs[-1]):] = 0.0  # (inside the clamp: the activation passes gradient there)
            return out

        @staticmethod
        def backward(ctx, grad):
            a, b, offs = ctx.saved_tensors
            with torch.enable_grad():
                a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
                da, db = torch.autograd.grad(real(a, b, offs=offs), (a, b), grad)
            da[int(offs[-1]):] = 1e3
            return da, db, None

    monkeypatch.setattr(moe_experts, "_GROUPED_MM", lambda a, b, offs: Unwritten.apply(a, b, offs))
    for kernel in ("grouped_mm", "padded_bmm"):
        experts.kernel = kernel
        for a, b in zip(grads(experts(x, counts, gates=gates)), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    per = int(counts.max())  # capacity's layout: each expert's rows in its own `per` slots
    slots = torch.cat([torch.arange(int(c)) + e * per for e, c in enumerate(counts.tolist())])
    padded = torch.zeros(E * per, D).index_copy(0, slots, x)
    padded_gates = torch.zeros(E * per).index_copy(0, slots, gates)
    out = experts(padded, None, fixed_groups(E, per), padded_gates).index_select(0, slots)
    for a, b in zip(grads(out), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg="capacity slots")
