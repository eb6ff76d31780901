"""QK-clip (optim/muon/qk_clip.py): the recorded largest logit per head is the written-out
S x S one (causal, documents, grouped-query), the clip scales W_q / W_k rows so the clipped
heads' largest logit on the same input is the threshold (at most it, grouped-query), and
FSDP2 dp 2 and ZeRO-1 dp 2 with clipping active match one process in float64."""

import pytest
import torch

from meshfold.errors import ConfigError
from meshfold.models.config import ModelConfig
from meshfold.models.llama import Attention, Transformer
from meshfold.optim.muon.qk_clip import QKClip, head_max_logits
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect


def written_out(q, k, scale, doc_ids=None):
    b, s, H, _ = q.shape
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
    if doc_ids is not None:
        mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    return logits.masked_fill(~mask, -torch.inf).amax(dim=(0, 2, 3))


def test_head_max_logits_is_the_written_out_masked_maximum(monkeypatch):
    from meshfold.optim.muon import qk_clip

    torch.manual_seed(0)
    q, k = torch.randn(2, 11, 4, 8, dtype=torch.float64), torch.randn(2, 11, 2, 8, dtype=torch.float64)
    docs = torch.tensor([[0] * 5 + [1] * 6, [0] * 11])
    monkeypatch.setattr(qk_clip, "QUERY_TILE", 3)  # several tiles
    for d in (None, docs):
        positions = None if d is None else torch.tensor([list(range(5)) + list(range(6)), list(range(11))])
        torch.testing.assert_close(head_max_logits(q, k, 0.3, positions, d), written_out(q, k, 0.3, d),
                                   rtol=1e-14, atol=0)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_clip_brings_the_largest_logit_to_the_threshold(kv_heads):
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, vocab_size=64, seq_len=16)
    model = Transformer(cfg).double()
    with torch.no_grad():
        for a in model.modules():
            if isinstance(a, Attention):
                a.wq.weight.mul_(torch.tensor([1.0, 8.0, 1.0, 16.0], dtype=torch.float64).repeat_interleave(8)[:, None])
    seen = []

    def spy(core, args, kwargs, out):
        seen.append(written_out(args[0].detach(), args[1].detach(), args[0].shape[-1] ** -0.5))

    attentions = [a for a in model.modules() if isinstance(a, Attention)]
    handles = [a.core.register_forward_hook(spy, with_kwargs=True) for a in attentions]
    clip = QKClip(model, threshold=2.0, alpha=0.5, group=None)
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens)
    before = [m.clone() for m in clip.max_logits]
    for got, want in zip(before, seen):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    clip.after_step()
    assert int(clip.clipped) > 0
    seen.clear()
    with torch.no_grad():
        model(tokens)
    # the first layer's input is unchanged (the later ones' follow the clipped attention)
    old, new = before[0], seen[0]
    hot = old > 2.0
    assert hot.any() and not hot.all()
    if kv_heads == 4:  # each head's own gamma on both sides: exactly tau
        torch.testing.assert_close(new[hot], torch.full_like(new[hot], 2.0), rtol=1e-12, atol=0)
    assert (new[hot] <= 2.0 + 1e-12).all()
    assert kv_heads != 4 or torch.equal(new[~hot], old[~hot])  # (grouped: a group's gamma reaches its other heads)
    for h in handles:
        h.remove()
    with pytest.raises(ConfigError, match="without tensor and context parallel"):
        QKClip(model, 2.0, 0.5, None, tp=2)


CLIP = {"optimizer": "muon", "steps": 4, "muon_qk_clip": 0.04}  # (logits ~0.03-0.05 here)
DENSE = {"n_layers": 3, "ffn_dim": 45}


def _train(cfg):
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg))
    trainer.capture_grads = True
    losses = trainer.fit()
    params = trainer.full_state()
    clipped = int(trainer.optimizer.qk_clip.clipped)
    return ({"losses": losses, "params": params, "grads": trainer.last_grads} if dist.get_rank() == 0 else None), clipped


def _train_all(cfgs):
    return [_train(c) for c in cfgs]


def test_fsdp_and_zero_one_with_qk_clip_match_one_process(tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "one"), model=DENSE, train=CLIP))
    layouts = [{"dp_shard": 2}, {"dp_shard": 2, "zero": 1}]
    cfgs = [tiny_config(str(tmp_path / str(i)), model=DENSE, parallel=p, train=CLIP) for i, p in enumerate(layouts)]
    results = run_on(2, _train_all, cfgs)
    for i, parallel in enumerate(layouts):
        (run, clipped), (_, clipped1) = results[0][i], results[1][i]
        assert clipped == clipped1 > 0, (parallel, clipped, clipped1)
        assert_runs_match(ref, run, rtol=1e-12, atol=1e-14)
