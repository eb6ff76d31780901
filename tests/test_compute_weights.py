"""bf16 compute weights for the layouts FSDP2 does not cast (parallel/compute_weights.py):
one cast per parameter per step, the residual stream in bf16, fp32 gradients accumulated
over micro-batches, fp32 parameters restored after the step; and the layouts that use them
(DDP, tp under ZeRO-1, the zero-bubble pipeline's split backward) against references."""

import copy

import torch
import torch.nn.functional as F

from meshfold.models.config import ModelConfig
from meshfold.models.llama import Transformer
from meshfold.parallel.compute_weights import ComputeWeights, master_parameters
from meshfold.testing import run_on, tiny_config, train_collect

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16, tie_embeddings=True)


def _loss(model, tokens):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def test_one_cast_per_step_fp32_accumulation_and_restore():
    """Two micro-batches inside one step: the modules hold the same bf16 copies for both
    (the tied output uses the embedding's), blocks take bf16 inputs, the fp32 parameters' gradients are
    exactly the fp32 sum of a bf16 model's per-micro-batch gradients, and the fp32
    Parameters are back in place afterwards."""
    torch.manual_seed(0)
    model = Transformer(MODEL)
    ref = copy.deepcopy(model)  # its parameters in bf16 (buffers, e.g. RoPE's, stay fp32 as in the run)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    micro = [torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1)) for _ in range(2)]
    weights = ComputeWeights([model], torch.bfloat16)
    masters = dict(model.named_parameters())
    seen, block_inputs = [], []
    hook = model.layers["0"].register_forward_pre_hook(lambda m, args: block_inputs.append(args[0].dtype))
    with weights.active():
        for tokens in micro:
            seen.append(model.layers["0"].attention.wq.weight)
            _loss(model, tokens).backward()
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert list(master_parameters(model)) == list(masters.values())
    hook.remove()
    assert seen[0] is seen[1] and seen[0].dtype == torch.bfloat16
    assert block_inputs == [torch.bfloat16, torch.bfloat16]
    assert dict(model.named_parameters()) == masters
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    for tokens in micro:
        ref.zero_grad()
        _loss(ref, tokens).backward()
        for n, p in ref.named_parameters():
            want[n] += p.grad.float()
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, n
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0, msg=n)


def test_step_refreshes_the_copies_and_evaluation_needs_no_graph():
    """A new step casts the updated fp32 values; a no_grad pass makes copies without a graph
    and leaves no gradients."""
    torch.manual_seed(0)
    model = Transformer(MODEL)
    weights = ComputeWeights([model], torch.bfloat16)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1))
    with torch.no_grad(), weights.active():
        assert model.norm.weight.grad_fn is None
        _loss(model, tokens)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        model.norm.weight.fill_(3.0)
    with weights.active():
        assert torch.equal(model.norm.weight, torch.full_like(model.norm.weight, 3.0))
        assert model.norm.weight.grad_fn is not None


def _bf16(run_dir, **sections):
    cfg = tiny_config(run_dir, **sections)
    cfg["train"].update({"dtype": "bfloat16", "steps": 2})
    return cfg


def test_layouts_with_compute_weights_train_like_one_process(tmp_path):
    """DDP (zero 0), tp 2 under ZeRO-1, and pp 2 with zbv's split backward (the weight
    gradients taken for the fp32 masters) in bf16: losses within 2 % of one process in
    bf16 (rounding differs with the split); zbv's gradients equal 1F1B's (the same
    products, summed in the same order) within bf16 accumulation noise; every gradient fp32."""
    ref = train_collect(_bf16(str(tmp_path / "ref")))
    runs = {
        "ddp": (2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}),
        "tp-zero1": (4, {"tp": 2, "dp_shard": 2, "zero": 1}),
        "pp-1f1b": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b", "pp_microbatches": 2}),
        "pp-zbv": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "zbv", "pp_microbatches": 2}),
    }
    got = {}
    for name, (world, parallel) in runs.items():
        model = {"n_layers": 4} if name.startswith("pp") else {}
        cfg = _bf16(str(tmp_path / name), parallel=parallel, model=model)
        got[name] = run_on(world, train_collect, cfg)[0]
        assert all(g.dtype == torch.float32 for g in got[name]["grads"].values()), name
    for name in ("ddp", "tp-zero1"):
        torch.testing.assert_close(torch.tensor(got[name]["losses"]), torch.tensor(ref["losses"]),
                                   rtol=2e-2, atol=0, msg=name)
    zbv, ofb = got["pp-zbv"], got["pp-1f1b"]
    torch.testing.assert_close(torch.tensor(zbv["losses"]), torch.tensor(ofb["losses"]), rtol=1e-3, atol=0)
    for n, g in ofb["grads"].items():
        torch.testing.assert_close(zbv["grads"][n], g, rtol=2e-2, atol=1e-4, msg=n)
