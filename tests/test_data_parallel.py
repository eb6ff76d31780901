"""Data parallel (DDP, ZeRO-1/2/3, HSDP) against a one-process reference, float64."""

import pytest

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = tiny_config(str(tmp_path_factory.mktemp("ref")))
    return train_collect(cfg)


LAYOUTS = [
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1}, id="ddp2"),
    pytest.param(2, {"dp_shard": 2, "zero": 1}, id="fsdp2-zero1"),
    pytest.param(2, {"dp_shard": 2, "zero": 2}, id="fsdp2-zero2"),
    pytest.param(2, {"dp_shard": 2, "zero": 3}, id="fsdp2-zero3"),
    pytest.param(4, {"dp_shard": 4, "zero": 1}, id="fsdp4-zero1"),
    pytest.param(4, {"dp_shard": 4, "zero": 2}, id="fsdp4-zero2"),
    pytest.param(4, {"dp_shard": 4, "zero": 3}, id="fsdp4-zero3"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "zero": 3}, id="hsdp2x2"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "zero": 1}, id="hsdp2x2-zero1"),
]


@pytest.mark.parametrize("world,parallel", LAYOUTS)
def test_matches_one_process(world, parallel, reference, tmp_path):
    got = run_on(world, train_collect, tiny_config(str(tmp_path), parallel=parallel))[0]
    assert_runs_match(reference, got)


def test_micro_batches_match_one_process(reference, tmp_path):
    # 8 sequences over 2 ranks in micro-batches of 2: gradient accumulation is exact.
    got = run_on(2, train_collect, tiny_config(str(tmp_path), parallel={"dp_shard": 2, "zero": 3},
                                               train={"micro_batch": 2}))[0]
    assert_runs_match(reference, got)


def test_mixed_precision_follows_the_resolved_dtype():
    """train.dtype = auto (the default) is bf16 on CUDA: FSDP2 (blocks and experts) gets the
    bf16 policy there, and none where auto means float32."""
    import torch

    from meshfold.config import TrainConfig
    from meshfold.parallel.dp.fsdp import fsdp_policies

    for dtype, device, want in (("auto", "cuda", torch.bfloat16), ("bfloat16", "cpu", torch.bfloat16),
                                ("auto", "cpu", None), ("float32", "cuda", None)):
        mp, _ = fsdp_policies(TrainConfig(dtype=dtype, reduce_dtype="float32"), device)
        assert mp.param_dtype == want, (dtype, device)
        assert mp.reduce_dtype == (torch.float32 if want else None)


def test_clip_is_a_device_scalar_foreach_multiply():
    """Clipping equals torch's over mixed-dtype gradients, never reads the norm on the host,
    and the norm of host-held gradients lands on the compute device given (offload = params:
    the collectives after it must get a device tensor; 'meta' stands for CUDA here)."""
    from unittest import mock

    import torch

    from meshfold.optim.clip import clip_grad_norm_, grad_norm

    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=dt)) for dt in (torch.float64, torch.float32)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, r in zip(ps, ref):
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        r.grad = p.grad.clone()
    with mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("host read")):
        norm = clip_grad_norm_(ps, 0.5)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    torch.testing.assert_close(norm, want.double(), rtol=1e-6, atol=0)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-9)
    on_device = grad_norm(ps, device=torch.device("meta"))
    assert on_device.device.type == "meta" and on_device.dtype == torch.float64
