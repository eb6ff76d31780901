"""Model shapes: exact parameter counts against published totals and live modules, FLOPs,
and layout-independent initialisation."""

import dataclasses

import pytest
import torch

from meshfold.config import ModelConfig
from meshfold.models.llama import Transformer, init_weights
from meshfold.models.counts import flops_per_token, matmul_params, param_count

# Published totals (model cards / papers), exact where the publisher gives exact numbers.
from meshfold.models.presets import PRESETS, preset

# Published totals (model cards / papers), exact where the publisher gives exact numbers.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,  # Touvron et al. 2023, HF model card
    "llama3-1b": 1_235_814_400,  # Llama 3.2 1B
    "llama3-3b": 3_212_749_824,  # Llama 3.2 3B
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    # The Hugging Face families (model cards; for tied models the card's count, which the
    # safetensors listing exceeds by the separately stored lm_head copy).
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 751_632_384 - 151_936 * 1024,
    "qwen3-1.7b": 2_031_739_904 - 151_936 * 2048,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,  # v0.3
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
    assert param_count(preset(name)) == PUBLISHED[name]


def test_gpt3_175b_is_175b():
    # Brown et al. 2020 report "175.0B"; the shape gives 174.6B (12·L·h² + embeddings + biases/norms).
    n = param_count(preset("gpt3-175b"))
    assert 174.5e9 < n < 175.1e9


SMALL_SHAPES = [
    ModelConfig(),
    ModelConfig(n_kv_heads=2, tie_embeddings=True),
    ModelConfig(norm="layernorm", mlp="gelu", bias=True, pos="learned", tie_embeddings=True),
    ModelConfig(dim=96, n_heads=6, n_kv_heads=3, ffn_dim=200, n_layers=3),
    ModelConfig(n_kv_heads=2, qkv_bias=True, tie_embeddings=True),  # Qwen2
    ModelConfig(n_kv_heads=2, qk_norm=True, attn_head_dim=32),  # Qwen3: head_dim != dim / n_heads
]


@pytest.mark.parametrize("cfg", SMALL_SHAPES, ids=lambda c: f"{c.norm}-{c.mlp}-kv{c.kv_heads}-tie{c.tie_embeddings}"
                         f"-qkvb{c.qkv_bias}-qkn{c.qk_norm}-hd{c.head_dim}")
def test_param_count_matches_live_model(cfg):
    model = Transformer(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_flops_per_token_formula():
    cfg = preset("llama3-8b")
    s = cfg.seq_len
    # 6 x matmul params + 12 x layers x seq x dim (attention scores and weighted sum, fwd+bwd)
    assert flops_per_token(cfg) == 6 * matmul_params(cfg) + 12 * cfg.n_layers * s * cfg.dim
    assert flops_per_token(cfg, causal=True) < flops_per_token(cfg)
    # Llama 3 8B at 8k context: ~6 * 7.5e9 + attention ~ 5.8e10 FLOPs per token.
    assert 5.0e10 < flops_per_token(cfg) < 6.5e10


def test_every_preset_builds_a_valid_config():
    from meshfold.config import Config, validate

    for name in PRESETS:
        cfg = Config(model=preset(name))
        validate(cfg)


def test_initialisation_is_name_seeded():
    cfg = ModelConfig(n_layers=3)
    full = Transformer(cfg)
    init_weights(full, cfg, seed=7)
    # A pipeline-like stage holding only layer 2 gets the same values for it.
    stage = Transformer(cfg)
    del stage.layers["0"], stage.layers["1"]
    init_weights(stage, cfg, seed=7)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p, dict(full.named_parameters())[name], rtol=0, atol=0)
    other = Transformer(cfg)
    init_weights(other, cfg, seed=8)
    assert not torch.equal(other.layers["0"].attention.wq.weight, full.layers["0"].attention.wq.weight)


def test_document_mask_blocks_cross_document_attention():
    cfg = ModelConfig(n_layers=1, vocab_size=64, seq_len=8)
    model = Transformer(cfg).double()
    init_weights(model, cfg, seed=0)
    tokens = torch.randint(0, 64, (1, 8))
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    full = model(tokens, doc_ids=doc_ids)
    # The second document alone (positions kept) gives the same logits as inside the pack.
    alone = model(tokens[:, 3:], positions=torch.arange(3, 8).unsqueeze(0), doc_ids=doc_ids[:, 3:])
    torch.testing.assert_close(full[:, 3:], alone)
    # Without the mask, the second document sees the first.
    assert not torch.allclose(model(tokens)[:, 3:], alone)


@pytest.mark.parametrize("cuda_heads", [False, True], ids=["grouped-kv", "kv-repeated-as-on-cuda"])
def test_default_document_attention_matches_the_dense_mask_without_host_reads_in_layers(monkeypatch, cuda_heads):
    """data.pack + data.doc_mask's default path: per-document windows (no S x S mask), equal to
    the dense-mask reference in values and gradients (GQA, a ragged last tile, documents
    across tile edges); the windows are planned once per forward, before the layers. On CUDA
    the windows' kv heads are repeated per query head (the masked fused kernel takes no GQA)."""
    from meshfold.models import attention_ops
    from meshfold.models.llama import CoreAttention

    if cuda_heads:
        monkeypatch.setattr(attention_ops, "on_cuda", lambda t: True)

    cfg = ModelConfig(n_layers=2, n_heads=4, n_kv_heads=2, dim=32, vocab_size=64, seq_len=40)
    model = Transformer(cfg).double()
    init_weights(model, cfg, seed=0)
    dense = Transformer(cfg).double()
    dense.load_state_dict(model.state_dict())
    for block in dense.layers.values():
        block.attention.core = CoreAttention(dense=True)
    for block in model.layers.values():
        block.attention.core.document_tile = 16  # 40 = 2.5 tiles
    lens = [[7, 20, 13], [40], [1, 2, 30, 7]][:2] + [[3, 30, 7]]
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lens])
    positions = torch.stack([torch.cat([torch.arange(n) for n in ls]) for ls in lens])
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(0))
    plans = []
    real_plan = attention_ops.DocumentPlan
    monkeypatch.setattr(attention_ops, "DocumentPlan", lambda *a: plans.append(a) or real_plan(*a))
    got = model(tokens, positions=positions, doc_ids=doc_ids)
    want = dense(tokens, positions=positions, doc_ids=doc_ids)
    assert len(plans) == 1  # one plan (one host read) for both layers
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_document_attention_takes_strided_rows_spanning_whole_tiles():
    """The loader hands out rows sliced from a wider buffer (inputs and doc_ids are views with
    a row stride of seq + 1); with the sequence a whole number of tiles nothing pads (copies)
    them. Found on a GPU machine's CPU reference run: the tile masks used ``view`` there."""
    from meshfold.models.llama import CoreAttention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    wide = torch.tensor([[0] * 5 + [1] * 20 + [2] * 8, [3] * 33])
    doc_ids = wide[:, :32]  # stride (33, 1): not contiguous
    assert not doc_ids.is_contiguous()
    core = CoreAttention()
    core.document_tile = 16
    got = core(q, k, v, doc_ids=doc_ids)
    want = CoreAttention(dense=True)(q, k, v, doc_ids=doc_ids.contiguous())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_document_runs_for_the_flash_varlen_kernel():
    """CUDA's packed-document path (flash varlen) attends within runs: a run ends where the
    document changes, where positions restart, and at the end of each row."""
    from meshfold.models.attention_ops import DocumentPlan

    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 2, 3]])
    cu, longest = DocumentPlan(doc_ids, positions, 4).runs
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 8, 12, 16] and longest == 5
    cu, longest = DocumentPlan(doc_ids, None, 4).runs  # positions default to the row's
    assert cu.tolist() == [0, 3, 8, 16] and longest == 8


def test_document_runs_come_from_the_loader_without_a_device_read(monkeypatch):
    """The loader finds the runs on the host batch (in its prefetch thread) and keeps them
    there when it moves the batch; the plan of a micro-batch's doc_ids then reads nothing
    back from the device (on a GPU that read was one sync per micro-batch)."""
    from meshfold.data.loader import HOST_RUN_STARTS, to_device, with_host_run_starts
    from meshfold.models import attention_ops

    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 2, 3]])
    batch = with_host_run_starts({"inputs": torch.zeros(2, 8, dtype=torch.long), "doc_ids": doc_ids,
                                  "positions": positions})
    moved = to_device(batch, torch.device("cpu"))
    assert moved[HOST_RUN_STARTS] is batch[HOST_RUN_STARTS]  # stays on the host
    mb = {k: v[1:2] for k, v in moved.items()}  # the second micro-batch of one row
    attention_ops.note_run_starts(mb["doc_ids"], mb.pop(HOST_RUN_STARTS))
    monkeypatch.setattr(attention_ops, "run_starts", lambda *a: pytest.fail("read the runs back from the device"))
    cu, longest = attention_ops.DocumentPlan(mb["doc_ids"], mb["positions"], 4).runs
    assert cu.tolist() == [0, 4, 8] and longest == 4


def test_document_attention_runs_on_fake_tensors():
    """The dry-run (fake tensors: shapes, no values) can run packed documents: the plan
    assumes every tile reaches one tile back instead of reading the windows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshfold.models.llama import CoreAttention

    with FakeTensorMode():
        q = torch.randn(2, 40, 4, 8)
        k = v = torch.randn(2, 40, 2, 8)
        doc_ids = torch.zeros(2, 40, dtype=torch.int64)
        core = CoreAttention()
        core.document_tile = 16
        out = core(q, k, v, doc_ids=doc_ids)
    assert out.shape == (2, 40, 4, 8)


def test_gqa_matches_repeated_kv_heads():
    cfg = ModelConfig(n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8)
    gqa = Transformer(cfg).double()
    init_weights(gqa, cfg, seed=1)
    mha_cfg = dataclasses.replace(cfg, n_kv_heads=4)
    mha = Transformer(mha_cfg).double()
    state = gqa.state_dict()
    hd = cfg.head_dim
    for w in ("wk", "wv"):
        key = f"layers.0.attention.{w}.weight"
        state[key] = state[key].view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_hf_family_presets_carry_their_features():
    assert preset("llama3.1-8b").rope_scaling == "llama3" and preset("llama3.2-1b").rope_factor == 32.0
    assert preset("qwen2.5-7b").qkv_bias and not preset("qwen2.5-7b").tie_embeddings
    q = preset("qwen3-4b")
    assert q.qk_norm and q.head_dim == 128 != q.dim // q.n_heads and q.tie_embeddings


def test_head_dim_and_qk_norm_shape_the_attention():
    cfg = ModelConfig(n_kv_heads=2, qk_norm=True, qkv_bias=True, attn_head_dim=24, rope_scaling="llama3",
                      rope_factor=8.0, rope_original_seq_len=16)
    model = Transformer(cfg).double()
    init_weights(model, cfg, seed=0)
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (4 * 24, 64) and attn.wk.bias.shape == (2 * 24,)
    assert attn.wo.bias is None and attn.q_norm.weight.shape == (24,)
    tokens = torch.randint(0, 512, (2, 16))
    out = model(tokens)
    # The per-head norm acts: scaling q_norm's weight changes the logits.
    with torch.no_grad():
        attn.q_norm.weight.mul_(3.0)
    assert not torch.allclose(model(tokens), out)


def test_rope_scaling_needs_its_original_context():
    from meshfold.config import Config, ConfigError, validate

    with pytest.raises(ConfigError, match="model.rope_original_seq_len"):
        validate(Config(model=ModelConfig(rope_scaling="llama3", rope_factor=8.0)))


def test_chunked_cross_entropy_equals_torch_in_value_and_gradient():
    """The loss of every path (parallel/loss.py): chunks of tokens (here 3 tokens of a
    20-wide vocabulary, a ragged last chunk), ignored labels, float64 and bf16 logits."""
    import torch.nn.functional as F

    from meshfold.data.dataset import IGNORE_INDEX
    from meshfold.parallel.loss import _ChunkedCE, cross_entropy_sum

    def vocab_parallel_formula(logits, labels, chunk_elements):  # the tp path's math, tp = 1
        return _ChunkedCE.apply(logits, labels, 0, None, chunk_elements)

    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 20, (2, 7), generator=gen)
    labels[0, 2] = labels[1, 6] = IGNORE_INDEX
    for fn, dtype, tol in ((cross_entropy_sum, torch.float64, 1e-12), (cross_entropy_sum, torch.bfloat16, 1e-2),
                           (vocab_parallel_formula, torch.float64, 1e-12)):
        logits = (3 * torch.randn(2, 7, 20, generator=gen)).to(dtype).requires_grad_()
        ref = logits.detach().clone().requires_grad_()
        loss = fn(logits, labels, chunk_elements=60)
        want = F.cross_entropy(ref.float().flatten(0, 1) if dtype != torch.float64 else ref.flatten(0, 1),
                               labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        torch.testing.assert_close(loss, want.to(loss.dtype), rtol=tol, atol=tol)
        (2.5 * loss).backward()
        (2.5 * want).backward()
        assert logits.grad.dtype == dtype
        torch.testing.assert_close(logits.grad, ref.grad, rtol=tol, atol=tol)
