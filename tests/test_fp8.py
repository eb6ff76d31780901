"""FP8 training (``meshfold/parallel/fp8/``): the config's checks, each recipe's GEMMs against
bf16 (forward and both gradients), FSDP2 with fp8 weight all-gathers on 2 gloo processes
against fp8 on one process, and checkpoints that stay in the master dtype (an fp8 run
resumes in bf16 and back; ``convert export`` writes no fp8)."""

import json

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from meshfold.cli import main  # noqa: E402
from meshfold.config import ConfigError, from_dict, validate  # noqa: E402
from meshfold.parallel.fp8.config import converts  # noqa: E402
from meshfold.parallel.fp8.convert import apply_fp8  # noqa: E402
from meshfold.testing import run_on, tiny_config, train_collect, train_segment  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")


def _cfg(run_dir, recipe="none", steps=10, **train):
    cfg = tiny_config(str(run_dir))
    cfg["train"].update({"dtype": "bfloat16", "steps": steps, "fp8": recipe, "lr": 3e-3, **train})
    return cfg


@pytest.mark.parametrize("train, parallel, needle", [
    ({"fp8": "rowwise", "fp8_all_gather": True}, {}, "train.fp8_all_gather"),
    ({"fp8": "mxfp8"}, {"tp": 2}, "parallel.tp"),  # tp runs tensorwise and rowwise
    ({"fp8": "tensorwise", "fp8_all_gather": True}, {"tp": 2}, "train.fp8_all_gather"),
    ({"fp8": "rowwise"}, {"ep_fp8_dispatch": True}, "parallel.ep_fp8_dispatch"),  # needs ep > 1
    ({"fp8": "fp4"}, {}, "train.fp8"),
])
def test_bad_combinations_fail_in_one_line(tmp_path, train, parallel, needle):
    cfg = tiny_config(str(tmp_path), parallel=parallel)
    cfg["train"].update(train)
    with pytest.raises(ConfigError) as err:
        validate(from_dict(cfg))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_what_stays_high_precision():
    assert converts("tensorwise", "layers.0.attention.wq", 256, 512)
    assert not converts("tensorwise", "output", 256, 512)  # the logits
    assert not converts("rowwise", "layers.0.moe.router", 256, 16)  # picks the experts
    assert not converts("rowwise", "layers.0.attention.wq", 256, 24)  # 24 is not a multiple of 16
    assert not converts("mxfp8", "layers.0.attention.wq", 256, 48)  # MXFP8 scales blocks of 32
    assert not converts("none", "layers.0.attention.wq", 256, 512)


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().float(), got.detach().float()
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


class _Train:
    def __init__(self, recipe):
        self.fp8, self.fp8_all_gather = recipe, False


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemm_sqnr_against_bf16(recipe):
    """One linear's output, input gradient and weight gradient under bf16 autocast."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 512, bias=False))
    fp8 = nn.Sequential(nn.Linear(256, 512, bias=False))
    fp8.load_state_dict(ref.state_dict())
    apply_fp8(fp8, _Train(recipe))
    assert type(fp8[0]) is not nn.Linear or type(fp8[0].weight) is not nn.Parameter  # converted
    x = torch.randn(128, 256)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        yr, yf = ref(xr), fp8(xf)
    g = torch.randn(128, 512)
    yr.float().backward(g)
    yf.float().backward(g)
    fwd, dx, dw = _sqnr(yr, yf), _sqnr(xr.grad, xf.grad), _sqnr(ref[0].weight.grad, fp8[0].weight.grad)
    print(f"{recipe}: forward {fwd:.1f} dB, input gradient {dx:.1f} dB, weight gradient {dw:.1f} dB")  # (pytest -s)
    assert fwd >= 25, (recipe, fwd)
    # tensorwise keeps torchao's e5m2 for the gradient (2 mantissa bits): 24.6 dB measured here
    grad_floor = 24 if recipe == "tensorwise" else 25
    assert dx >= grad_floor and dw >= grad_floor, (recipe, dx, dw)


def test_tensorwise_gradient_sqnr_is_e5m2s_two_mantissa_bits():
    """Why tensorwise's gradient GEMMs measure 24.6 dB (< the issue's 25): torchao's tensorwise
    recipe casts the output gradient to e5m2 (2 mantissa bits, for its range), the others to
    e4m3 (3 bits). The same gradient cast alone with one scale: e5m2 25.6 dB, e4m3 31.5 dB
    (about 6 dB a bit); the GEMM's SQNR follows its worse operand (the weight in e4m3)."""
    torch.manual_seed(0)
    g = torch.randn(128, 512).bfloat16().float()
    alone = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.finfo(dtype).max / g.abs().max()
        alone[dtype] = _sqnr(g, (g * scale).to(dtype).float() / scale)
    print(f"one gradient cast alone: e4m3 {alone[torch.float8_e4m3fn]:.1f} dB, e5m2 {alone[torch.float8_e5m2]:.1f} dB")
    assert 25 < alone[torch.float8_e5m2] < 26.5 and alone[torch.float8_e4m3fn] - alone[torch.float8_e5m2] > 5, alone
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    assert config.cast_config_grad_output.target_dtype == torch.float8_e5m2  # the recipe's own choice
    assert config.cast_config_input.target_dtype == config.cast_config_weight.target_dtype == torch.float8_e4m3fn


def _spread(one: dict, two: dict) -> dict:
    """Per parameter: |two - one| / |one| (norms) after the run."""
    return {n: float((two["params"][n].float() - v.float()).norm() / v.float().norm()) for n, v in one["params"].items()}


def test_fsdp2_fp8_all_gather_equals_one_process(tmp_path):
    """10 steps of FSDP2 (zero 3, 2 gloo processes) gathering tensorwise fp8 weights (as
    uint8 bytes on gloo) against the same recipe on one process, and rowwise (bf16
    gathers) likewise: the losses agree to 2e-3 and the parameters' relative distance stays
    within a small multiple of bf16's own one- against two-process distance (the reductions'
    order differs; fp8's coarser rounding amplifies it)."""
    spreads = {}
    for recipe, gather in (("none", False), ("tensorwise", True), ("rowwise", False)):
        one = train_collect(_cfg(tmp_path / f"{recipe}-1", recipe, fp8_all_gather=gather))
        two = run_on(2, train_collect, _cfg(tmp_path / f"{recipe}-2", recipe, fp8_all_gather=gather) | {
            "parallel": {"dp_shard": 2, "zero": 3}})[0]
        torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0)
        spreads[recipe] = _spread(one, two)
    for recipe in ("tensorwise", "rowwise"):
        for name, spread in spreads[recipe].items():
            # measured: bf16 <= 0.022, rowwise <= 0.034, tensorwise <= 0.10 (e5m2 gradients:
            # a rounding flip moves a value by 12.5% where bf16's moves it by 0.4%)
            assert spread <= 0.12, (recipe, name, spread, spreads["none"][name])


def test_checkpoints_stay_in_master_dtype(tmp_path):
    """An fp8 run (FSDP2, fp8 gathers, 2 processes) saves fp32 masters; bf16 on one process
    resumes it, and an fp8 run resumes that; the export holds no float8 tensor."""
    run = tmp_path / "run"

    def cfg(recipe, **parallel):
        c = _cfg(run, recipe, steps=6, fp8_all_gather=recipe == "tensorwise")
        c["parallel"].update(parallel)
        return c

    first = run_on(2, train_segment, cfg("tensorwise", dp_shard=2, zero=3), 2)[0]
    second = train_segment(cfg("none"), 4)
    third = train_segment(cfg("rowwise"), 6, save=True)
    assert (first["start"], second["start"], third["start"]) == (0, 2, 4)
    assert all(v.dtype == torch.float32 for v in third["params"].values())
    assert all(abs(a - b) < 0.5 for a, b in zip(second["losses"], third["losses"]))  # one run, continued

    out = tmp_path / "hf"
    assert main(["convert", "export", str(run / "checkpoints" / "step-6"), str(out), "--dtype", "bfloat16"]) == 0
    from safetensors.torch import load_file

    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert tensors and all(v.dtype == torch.bfloat16 for v in tensors.values())
    assert json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("recipe, gemm, error", [
    ("tensorwise", "float8_e4m3fn", None),
    ("mxfp8", "float8_e4m3fn", "mx GEMMs need compute capability sm100"),
])
def test_cuda_dry_run_records_fp8_gemms(tmp_path, capsys, recipe, gemm, error):
    """The fake-CUDA step (an H100): block linears' GEMMs in float8, the output layer's in
    bf16; MXFP8 refused in one line (Blackwell only)."""
    argv = ["dry-run", "configs/debug.toml", "--world", "2", "--device", "cuda", "--json",
            "--set", f"train.fp8={recipe}", "--set", "train.dtype=bfloat16", "--set", "parallel.zero=3"]
    code = main(argv)
    g = json.loads(capsys.readouterr().out)["gpu"]
    assert g["gemms"][gemm] > 0 and g["gemms"]["bfloat16"] > 0
    if error is None:
        assert code == 0 and g["errors"] == []
        assert g["gemms"]["bfloat16"] == 3  # the output layer: forward, input and weight gradients
    else:
        assert code == 1 and [e for e in g["errors"] if error in e] == [g["errors"][0]] and len(g["errors"]) == 1


def test_planner_prices_fp8_gemms(capsys):
    """``train.fp8`` prices the block GEMMs at the device's fp8 peak (plus the casts): a
    shorter predicted step on an H100 cluster; ``none`` is the bf16 plan unchanged. Compiled
    (``train.compile``): the planner prices eager casts as torchao's op-by-op sequence, as
    measured on an H200 (eager tensorwise slower than bf16, docs/gpu.md), so fp8 pays off
    fused, where torchtitan runs it."""
    def step(recipe):
        assert main(["simulate", "configs/llama3-8b.toml", "--cluster", "h100:64", "--json", "--set", "train.compile=true",
                     "--set", "parallel.dp_shard=64", "--set", "parallel.zero=3", "--set", f"train.fp8={recipe}"]) == 0
        return json.loads(capsys.readouterr().out)["step_time_s"]

    bf16, fp8 = step("none"), step("tensorwise")
    assert 0.6 * bf16 < fp8 < 0.95 * bf16


def test_planner_times_fp8_weight_gathers_at_their_bytes(capsys):
    """With ``train.fp8_all_gather`` FSDP2 gathers the converted linears' weights in fp8: the
    planner's exposed data-parallel time falls with the bytes it reports (half of those
    weights' bf16 bytes), and the step with it."""
    def run(*extra):
        assert main(["simulate", "configs/llama3-8b.toml", "--cluster", "h100:64", "--json", "--set",
                     "train.compile=true", "--set", "parallel.dp_shard=64", "--set", "parallel.tp=1", "--set",
                     "parallel.zero=3", "--set", "train.fp8=tensorwise", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["step_time_s"], out["breakdown"]["time_s"]["dp_exposed"]

    (step, dp), (step8, dp8) = run(), run("--set", "train.fp8_all_gather=true")
    assert dp8 < 0.85 * dp and step8 < step


def _tp_gemms_against_one_process(recipes) -> dict:
    """On each of 2 ranks: a Float8Linear's output and both gradients computed whole (the
    one-process reference), and on this rank's column- and row-parallel pieces through
    ``tp_gemm``, and as a replicated linear on this rank's half of the tokens under sp (MLA's
    down-projections); returns rank 0's largest relative errors (fp32 operands, no autocast)."""
    import torch.distributed as dist

    from meshfold.parallel.tp.collectives import COLUMN, REPLICATED, ROW, TensorParallelGroup, tp_gemm

    rank = dist.get_rank()
    tp = TensorParallelGroup(None, dist.group.WORLD, 2, rank, False)
    tp_sp = TensorParallelGroup(None, dist.group.WORLD, 2, rank, True)
    errors = {}
    for recipe in recipes:
        torch.manual_seed(0)
        lin = nn.Sequential(nn.Linear(128, 64, bias=False))
        with torch.no_grad():  # outliers in rank 0's pieces: rank 1's local amaxes would be 50x smaller
            lin[0].weight[:, 0] *= 50
            lin[0].weight[0, :] *= 50
        apply_fp8(lin, _Train(recipe), tp_size=2)
        x, g = torch.randn(32, 128), torch.randn(32, 64)
        x[:, 0] *= 50
        g[:, 0] *= 50
        x.requires_grad_()
        y = lin(x)
        y.backward(g)
        for split in (COLUMN, ROW):
            dim = 0 if split == COLUMN else 1  # the weight's split axis
            w = lin[0].weight.detach().chunk(2, dim)[rank].clone().requires_grad_()
            xl = (x.detach() if split == COLUMN else x.detach().chunk(2, 1)[rank]).clone().requires_grad_()
            out = tp_gemm(lin[0], tp, split)(xl, w)
            if split == ROW:  # the partial sums, as the row-parallel layer's reduction adds them
                out = tp.all_reduce_(out.detach().clone()).requires_grad_()
                out.backward(g)  # (identity backward: the gradient reaches the GEMM below)
                tp_gemm(lin[0], tp, split)(xl, w).backward(g)
                ref_y = y
            else:
                out.backward(g.chunk(2, 1)[rank])
                ref_y = y.chunk(2, 1)[rank]
            ref_dx = x.grad if split == COLUMN else x.grad.chunk(2, 1)[rank]
            if split == COLUMN:  # the column layer's input gradient is summed over tp
                dx = tp.all_reduce_(xl.grad.clone())
            else:
                dx = xl.grad
            ref_dw = lin[0].weight.grad.chunk(2, dim)[rank]
            rel = {k: float((a - b).norm() / b.norm()) for k, a, b in
                   (("y", out.detach(), ref_y.detach()), ("dx", dx, ref_dx), ("dw", w.grad, ref_dw))}
            errors[(recipe, split)] = rel
        # replicated under sp: the tokens split, outliers in rank 1's (rank 0's local amaxes 50x smaller)
        xr, gr = x.detach().clone(), g.clone()
        xr[16:] *= 50
        gr[16:] *= 50
        xr.requires_grad_()
        lin[0].weight.grad = None
        y = lin(xr)
        y.backward(gr)
        mine = slice(16 * rank, 16 * rank + 16)
        xl, w = xr.detach()[mine].clone().requires_grad_(), lin[0].weight.detach().clone().requires_grad_()
        out = tp_gemm(lin[0], tp_sp, REPLICATED)(xl, w)
        out.backward(gr[mine])
        dw = tp.all_reduce_(w.grad.clone())  # this rank's tokens' share, summed over tp (``tp.replicated``)
        errors[(recipe, REPLICATED)] = {k: float((a - b).norm() / b.norm()) for k, a, b in
                                        (("y", out.detach(), y.detach()[mine]), ("dx", xl.grad, xr.grad[mine]),
                                         ("dw", dw, lin[0].weight.grad))}
    return errors


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_tensor_parallel_gemms_equal_the_one_process_gemm(recipe):
    """Column- and row-parallel fp8 GEMMs (``parallel/fp8/tp.py``), and a replicated one on
    each rank's tokens under sp, against the same Float8Linear computed whole, 2 gloo ranks,
    fp32 operands. The fp8 operands are the
    same values cast with the same (tp-reduced) scales, so the pieces match to fp32
    summation order (<= 1e-5). Per-row scaled GEMMs with an fp32 result come out of
    torchao's ``_scaled_mm`` call rounded to bf16: a tp partial sum (row-parallel output,
    column-parallel input gradient) is rounded before the sum, the one-process GEMM after
    it, so those agree to one bf16 rounding (2^-8; 2.4e-3 measured; the replicated weight
    gradient's two partial sums: 2.1e-3). With each rank's own local scales instead
    (outliers sit in rank 0's pieces) tensorwise misses by 1.1e-3 (replicated, outliers in
    rank 1's tokens: the output by 3.3e-2, the input gradient by 6.9e-2); the
    rowwise recipes round scales to powers of 2, which move no e4m3 rounding short of
    underflow, so for them the check is the pieces' agreement itself."""
    errors = run_on(2, _tp_gemms_against_one_process, [recipe])[0]
    bound = 1e-5 if recipe == "tensorwise" else 2 ** -8
    for key, rel in errors.items():
        assert max(rel.values()) <= bound, (key, rel)


def _tp_cfg(run_dir, recipe, **parallel):
    cfg = _cfg(run_dir, recipe)
    # widths that stay 16-aligned once split over tp 2 (wk/wv: 2 kv heads of 16)
    cfg["model"].update({"dim": 64, "ffn_dim": 128})
    cfg["parallel"].update(parallel)
    return cfg


def _tp_runs(tmp_path, recipe):
    """One process, tp 2, tp 2 + sp and tp 2 x FSDP 2 (zero 3) of ``recipe``: their losses
    and parameters (four spawns in all, shared by the tests below)."""
    runs = {"one": train_collect(_tp_cfg(tmp_path / f"{recipe}-one", recipe))}
    for name, n, parallel in (("tp2", 2, {"tp": 2, "dp_shard": 1}), ("tp2sp", 2, {"tp": 2, "sp": True, "dp_shard": 1}),
                              ("tp2fsdp2", 4, {"tp": 2, "dp_shard": 2, "zero": 3})):
        runs[name] = run_on(n, train_collect, _tp_cfg(tmp_path / f"{recipe}-{name}", recipe, **parallel))[0]
    return runs


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tensor_parallel_fp8_equals_one_process(tmp_path, recipe):
    """fp8 under tensor parallel (``parallel/fp8/tp.py``: every cast's scale max-reduced over
    tp where its axis is split, so each rank casts with the one-process scale): tp 2, tp 2 +
    sp and tp 2 x FSDP 2 against one process of the same recipe, 10 steps. Losses within
    2e-3 relative, as for FSDP2 above: each rank's fp8 operands are bit-identical slices of
    the one-process ones, so only the row-parallel sums' order (and, under FSDP2, the
    gradient reduction's) differs, and fp8 rounding can flip on such a difference (measured:
    <= 5.3e-4). Parameters within 0.15 relative norm distance (measured: rowwise <= 0.075,
    tensorwise <= 0.087, and 0.117 for tp 2 x FSDP 2, where e5m2 gradients' rounding flips
    move a value by 12.5%: the FSDP2 test above sees 0.10)."""
    runs = _tp_runs(tmp_path, recipe)
    one = runs.pop("one")
    for name, run in runs.items():
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0,
                                   msg=lambda m, name=name: f"{recipe} {name}: {m}")
        for param, spread in _spread(one, run).items():
            assert spread <= 0.15, (recipe, name, param, spread)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_expert_grouped_gemm_sqnr_against_bf16(recipe):
    """One grouped GEMM of the routed experts in fp8 (``parallel/fp8/experts.py``: rowwise
    e4m3 emulated as torchao's Hopper recipe; MXFP8 through torchao's emulated kernel)
    against bf16's, groups of 32, 0, 64 and 32 rows plus spare rows after the last (as the
    padded layout has them), forward and both gradients: >= 25 dB each. Then a whole
    ``GroupedExperts`` (two GEMMs and the SwiGLU between, uneven groups the module pads):
    >= 22 dB (two fp8 GEMMs' errors add: 23.4 dB measured for rowwise)."""
    from meshfold.models.moe_experts import GroupedExperts
    from meshfold.parallel.fp8.experts import apply_fp8_experts

    torch.manual_seed(0)
    ref, fp8 = GroupedExperts(4, 64, 96), GroupedExperts(4, 64, 96)
    for p in ref.parameters():
        nn.init.normal_(p, std=0.05)
    fp8.load_state_dict(ref.state_dict())
    apply_fp8_experts(fp8, recipe)
    assert fp8.grouped_mm is not None and fp8.group_rows == (32 if recipe == "mxfp8" else 16)

    offs = torch.tensor([32, 32, 96, 128], dtype=torch.int32)
    a = torch.randn(160, 64, dtype=torch.bfloat16)
    w = (torch.randn(4, 96, 64) * 0.05).to(torch.bfloat16)
    outs = {}
    for name, gemm in (("ref", torch.nn.functional.grouped_mm), ("fp8", fp8.grouped_mm)):
        ai, wi = a.clone().requires_grad_(), w.clone().requires_grad_()
        y = gemm(ai, wi.transpose(-2, -1), offs=offs)
        y[:128].backward(torch.ones(128, 96).normal_(generator=torch.Generator().manual_seed(1)).to(y.dtype))
        outs[name] = (y[:128], ai.grad[:128], wi.grad)
    gemm_sqnr = [_sqnr(r, f) for r, f in zip(outs["ref"], outs["fp8"])]
    assert min(gemm_sqnr) >= 25, (recipe, gemm_sqnr)

    counts = torch.tensor([37, 0, 70, 21])
    x = torch.randn(int(counts.sum()), 64, dtype=torch.bfloat16)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        yr, yf = ref(xr, counts), fp8(xf, counts)
    g = torch.randn_like(yr)
    yr.backward(g)
    yf.backward(g)
    got = {"y": _sqnr(yr, yf), "dx": _sqnr(xr.grad, xf.grad)}
    got |= {n: _sqnr(p.grad, dict(fp8.named_parameters())[n].grad) for n, p in ref.named_parameters()}
    assert min(got.values()) >= 22, (recipe, got)


def _moe_cfg(run_dir, recipe, **parallel):
    cfg = _cfg(run_dir, recipe, steps=6)
    cfg["model"].update({"dim": 64, "ffn_dim": 128, "moe_experts": 4, "moe_topk": 2, "moe_ffn_dim": 64})
    cfg["parallel"].update(parallel)
    return cfg


def test_moe_experts_train_in_fp8(tmp_path):
    """6 steps of a MoE model with its routed experts' grouped GEMMs in fp8 (rowwise
    emulated, MXFP8 emulated) against bf16 on one process, and rowwise under ep 2 (2 gloo
    processes) against rowwise on one: fp8's losses within 1% of bf16's (two fp8 GEMMs per
    expert, 23-24 dB each way; 1.6e-3 measured), ep 2's within 3e-3 relative of one process
    (1.4e-3 measured: the same casts on the same rows, but the gradients' reductions run in
    another order and an fp8 rounding can flip on such a difference)."""
    from meshfold.parallel.fp8 import experts as fp8_experts

    bf16 = train_collect(_moe_cfg(tmp_path / "bf16", "none"))
    calls = {"n": 0}
    real = fp8_experts._RowwiseGroupedMM.forward

    def counted(ctx, *args):
        calls["n"] += 1
        return real(ctx, *args)

    fp8_experts._RowwiseGroupedMM.forward = staticmethod(counted)
    try:
        rowwise = train_collect(_moe_cfg(tmp_path / "rowwise", "rowwise"))
    finally:
        fp8_experts._RowwiseGroupedMM.forward = staticmethod(real)
    assert calls["n"] == 6 * 2 * 2  # steps x MoE layers x the experts' two GEMMs
    mxfp8 = train_collect(_moe_cfg(tmp_path / "mxfp8", "mxfp8"))
    for run in (rowwise, mxfp8):
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(bf16["losses"]), rtol=1e-2, atol=0)
    ep2 = run_on(2, train_collect, _moe_cfg(tmp_path / "ep2", "rowwise", dp_shard=2, ep=2))[0]
    torch.testing.assert_close(torch.tensor(ep2["losses"]), torch.tensor(rowwise["losses"]), rtol=3e-3, atol=0)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_expert_parallel_fp8_equals_one_process_over_10_steps(tmp_path, recipe):
    """ep 2 x FSDP2 (zero 3, 2 gloo processes) against one process of the same recipe over 10
    steps, as the issue asks of FSDP2 and tp: tensorwise with fp8 weight all-gathers (the
    attention's and the dense layers' linears; the experts, their own FSDP group, gathered
    in bf16 and computed rowwise), and MXFP8 (the experts' emulated MXFP8 grouped GEMMs on
    each rank's experts). Losses within 2e-3 relative, the FSDP2 test's bound (measured:
    1.2e-3 tensorwise, 1.4e-3 mxfp8; bf16 itself 2.3e-4)."""
    def cfg(name, **parallel):
        c = _moe_cfg(tmp_path / name, recipe, **parallel)
        c["train"].update({"steps": 10, "fp8_all_gather": recipe == "tensorwise"})
        return c

    one = train_collect(cfg("one"))
    ep2 = run_on(2, train_collect, cfg("ep2", dp_shard=2, ep=2, zero=3))[0]
    torch.testing.assert_close(torch.tensor(ep2["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0)


def _ep_bytes(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["comm_bytes"]["ep"] for line in lines if '"comm_bytes"' in line]


def test_ep_fp8_dispatch_against_bf16_dispatch(tmp_path):
    """ep 2 (2 gloo processes), rowwise fp8 experts, the dispatch's rows in fp8 (uint8 bytes
    on gloo, a scale per row beside) against the same run dispatching in the compute dtype:
    every loss the same to 1e-6 relative (the experts cast the same rows with power-of-2
    scales, per row and per column, which round to e4m3's grid whatever the scale: a row
    already on it comes through unchanged; identical here, measured); fewer ep bytes per step
    (67.9 kB -> 59.7 kB at step 1: the combine and the gradients' exchanges stay as they were)."""
    runs = {}
    for fp8_dispatch in (False, True):
        run_dir = tmp_path / f"dispatch-{fp8_dispatch}"
        cfg = _moe_cfg(run_dir, "rowwise", dp_shard=2, ep=2, ep_fp8_dispatch=fp8_dispatch)
        runs[fp8_dispatch] = (run_on(2, train_collect, cfg)[0]["losses"], _ep_bytes(run_dir))
    (bf16_losses, bf16_bytes), (fp8_losses, fp8_bytes) = runs[False], runs[True]
    torch.testing.assert_close(torch.tensor(fp8_losses), torch.tensor(bf16_losses), rtol=1e-6, atol=0)
    assert fp8_bytes and all(f < b for f, b in zip(fp8_bytes, bf16_bytes)), (fp8_bytes, bf16_bytes)


def test_ep_fp8_dispatch_in_chunks(tmp_path):
    """The pipelined exchange (``parallel.ep_overlap_chunks = 2``, ep 2, 2 gloo processes)
    with the dispatch's rows in fp8, each chunk's rows cast with their own per-row scales
    (``Float8InFlight``), against the same chunks dispatched in the compute dtype: every loss
    the same to 1e-6 relative (as unchunked above: identical, measured), fewer ep bytes; and
    against rowwise on one process within 3e-3 relative, as the unchunked ep 2 run above."""
    one = train_collect(_moe_cfg(tmp_path / "one", "rowwise"))
    runs = {}
    for fp8_dispatch in (False, True):
        run_dir = tmp_path / f"chunks-{fp8_dispatch}"
        cfg = _moe_cfg(run_dir, "rowwise", dp_shard=2, ep=2, ep_overlap_chunks=2, ep_fp8_dispatch=fp8_dispatch)
        runs[fp8_dispatch] = (run_on(2, train_collect, cfg)[0]["losses"], _ep_bytes(run_dir))
    (bf16_losses, bf16_bytes), (fp8_losses, fp8_bytes) = runs[False], runs[True]
    torch.testing.assert_close(torch.tensor(fp8_losses), torch.tensor(bf16_losses), rtol=1e-6, atol=0)
    assert fp8_bytes and all(f < b for f, b in zip(fp8_bytes, bf16_bytes)), (fp8_bytes, bf16_bytes)
    torch.testing.assert_close(torch.tensor(fp8_losses), torch.tensor(one["losses"]), rtol=3e-3, atol=0)


_MOE = {"moe_experts": 4, "moe_topk": 2, "ffn_dim": 128, "moe_ffn_dim": 64}
# DeepSeek's latent attention with every linear 32-aligned (tp 2 splits them to 16): its
# down-projections (replicated; under sp on each rank's tokens), up-projections (column) and
# wo (row) all convert.
_MLA = {"dim": 64, "ffn_dim": 128, "n_heads": 4, "n_kv_heads": 0, "mla_kv_rank": 32, "mla_q_rank": 32,
        "mla_rope_dim": 32, "mla_nope_dim": 32, "mla_v_dim": 16}


# The dry-run (the real step on fake ranks) and the planner agree exactly on every mesh
# dimension's collective calls and bytes under fp8: FSDP2's fp8 gathers, the fp8 dispatch's
# rows and scales (one more all-to-all each), tensor parallel's amax all-reduces and, under
# sp, the re-gathers fp8 column groups skip.
@pytest.mark.parametrize("world, parallel, train, model", [
    (2, {"dp_shard": 2, "zero": 3}, {"fp8": "tensorwise", "fp8_all_gather": True}, {}),
    (2, {"dp_shard": 2, "ep": 2, "zero": 3, "ep_fp8_dispatch": True}, {"fp8": "rowwise"}, _MOE),
    (2, {"dp_shard": 2, "ep": 2, "zero": 3, "ep_fp8_dispatch": True, "ep_overlap_chunks": 2}, {"fp8": "rowwise"}, _MOE),
    (2, {"dp_shard": 2, "ep": 2, "zero": 3, "ep_fp8_dispatch": True, "ep_overlap_chunks": 2}, {"fp8": "rowwise"},
     {**_MOE, "moe_capacity_factor": 1.5}),
    (2, {"tp": 2, "dp_shard": 1, "zero": 0}, {"fp8": "rowwise_with_gw_hp"}, {}),
    (4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3}, {"fp8": "tensorwise"}, {"ffn_dim": 128}),
    (4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3}, {"fp8": "rowwise", "recompute": "full"}, {}),
    (2, {"tp": 2, "sp": True, "dp_shard": 1, "zero": 0}, {"fp8": "tensorwise"}, _MLA),
    (2, {"tp": 2, "sp": True, "dp_shard": 1, "zero": 0}, {"fp8": "rowwise"}, {**_MLA, "mla_q_rank": 0}),
    (2, {"tp": 2, "dp_shard": 1, "zero": 0}, {"fp8": "tensorwise"}, _MLA),
], ids=["fsdp2-fp8-gathers", "ep2-fp8-dispatch", "ep2-fp8-dispatch-chunks", "ep2-fp8-dispatch-capacity-chunks",
        "tp2-gw-hp", "tp2-sp-fsdp2-tensorwise", "tp2-sp-fsdp2-rowwise-full", "mla-tp2-sp-tensorwise",
        "mla-full-q-tp2-sp-rowwise", "mla-tp2-tensorwise"])
def test_dry_run_agrees_with_planner_under_fp8(tmp_path, world, parallel, train, model):
    from meshfold.dryrun import dry_run

    cfg = tiny_config(str(tmp_path), parallel=parallel, train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", **train})
    cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, **model})
    out = dry_run(from_dict(cfg), world, cluster="h100")
    assert out["planner"]["collectives"] == out["runtime"]["collectives"]


def test_planner_counts_fp8_on_the_wire():
    """llama3-8b on 64 H100s, zero 3: with fp8 all-gathers the planner's dp bytes drop by
    the block linears' half of the gathers (the reduce-scatters stay in bf16; 49.5 GB
    measured in the dry-run against 63.2 GB, docs/fp8.md)."""
    from meshfold.config import load_config
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel
    from meshfold.planner.from_config import layout_from_config, workload_from_config

    def dp_bytes(*overrides):
        cfg = load_config("configs/llama3-8b.toml", ["parallel.dp_shard=64", "parallel.zero=3", *overrides])
        est = CostModel(workload_from_config(cfg, True), load_cluster("h100:64")).estimate(
            layout_from_config(cfg, 64), detail=True)
        return est.collectives["dp"]["bytes"]

    bf16, fp8 = dp_bytes(), dp_bytes("train.fp8=tensorwise", "train.fp8_all_gather=true")
    assert 0.7 * bf16 < fp8 < 0.85 * bf16, (bf16, fp8)


def test_cuda_dry_run_names_float8_on_the_wire(capsys):
    """``gpu.wire_dtypes`` names fp8 payloads float8: FSDP2's packed gather of a block's fp8
    weights and bf16 norms (one uint8 buffer) by what it packs, the fp8 dispatch's rows by
    their own dtype (its scales: float32)."""
    def wire(*overrides):
        argv = ["dry-run", "configs/debug.toml", "--world", "2", "--device", "cuda", "--json",
                "--set", "train.dtype=bfloat16", "--set", "parallel.zero=3"]
        assert main(argv + [x for o in overrides for x in ("--set", o)]) == 0
        return json.loads(capsys.readouterr().out)["gpu"]["wire_dtypes"]

    assert wire("train.fp8=tensorwise", "train.fp8_all_gather=true")["dp"] == ["bfloat16", "float8_e4m3fn"]
    assert wire("train.fp8=tensorwise")["dp"] == ["bfloat16"]  # weights gathered in bf16, cast after
    ep = wire("train.fp8=rowwise", "model.moe_experts=4", "model.dim=64", "model.ffn_dim=128", "parallel.ep=2",
              "parallel.ep_fp8_dispatch=true")["ep"]
    assert {"float8_e4m3fn", "float32", "bfloat16"} <= set(ep), ep


@pytest.mark.parametrize("world, parallel, model, extra", [
    (4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 1}, {"ffn_dim": 128}, 2 * 2 * 64 * 64 * 2 // 2),
    # MLA with a full-rank q: wkv_a reads the block input too, so its local 1/tp stays kept
    (2, {"tp": 2, "sp": True, "dp_shard": 1, "zero": 0}, "mla-full-q", 2 * (64 * 64 * 2 + 64 * 64 * 2 // 2)),
], ids=["gqa", "mla-full-q"])
def test_planner_prices_the_inputs_fp8_keeps_under_sp(tmp_path, world, parallel, model, extra):
    """tp 2 + sp (fake ranks, the dry-run's saved-tensor count): a column group with an fp8
    linear keeps its gathered input for backward (torchao's matmul and ``parallel/fp8/tp.py``
    save the high-precision input; ``_GatheredLinears`` keeps only the rank's 1/tp and gathers
    again), so tensorwise holds more activations than bf16: 16,384 bytes for GQA (2 layers x
    2 column groups x 64 tokens x 64 x 2 bytes / 2), 24,576 for MLA with a full-rank q (its q
    group keeps the whole gathered input beside the local one its kv down-projection keeps
    anyway). The planner adds exactly that, and stays within the dry-run tests' 10 % of the
    runtime's count."""
    from meshfold.dryrun import dry_run

    model = {**_MLA, "mla_q_rank": 0} if model == "mla-full-q" else model
    acts = {}
    for recipe in ("none", "tensorwise"):
        cfg = tiny_config(str(tmp_path / recipe), parallel=parallel,
                          train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "fp8": recipe})
        cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, **model})
        out = dry_run(from_dict(cfg), world, cluster="h100")
        acts[recipe] = (out["runtime"]["activation_bytes"], out["planner"]["activation_bytes"])
        assert acts[recipe][1] == pytest.approx(acts[recipe][0], rel=0.10), (recipe, acts)
    (rt, pl), (rt8, pl8) = acts["none"], acts["tensorwise"]
    assert rt8 - rt == pl8 - pl == extra, acts


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_latent_attention_under_tensor_parallel_fp8_equals_one_process(tmp_path, recipe):
    """MLA's linears in fp8 under tensor parallel (``parallel/tp/mla.py`` through ``tp_gemm``:
    the low-rank q and kv down-projections replicated, on each rank's sequence slice under
    sp with their weight gradient's scales reduced over tp; the up-projections column-, wo
    row-parallel): tp 2 and tp 2 + sp against one process of the same recipe, 10 steps, with
    the dense test's tolerances: losses within 2e-3 relative (measured <= 1.1e-3 tensorwise,
    3.1e-4 rowwise), parameters within 0.15 relative norm distance (measured <= 0.099)."""
    def cfg(name, **parallel):
        c = _cfg(tmp_path / name, recipe)
        c["model"].update(_MLA)
        c["parallel"].update(parallel)
        return c

    one = train_collect(cfg("one"))
    for name, parallel in (("tp2", {"tp": 2, "dp_shard": 1}), ("tp2sp", {"tp": 2, "sp": True, "dp_shard": 1})):
        run = run_on(2, train_collect, cfg(name, **parallel))[0]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one["losses"]), rtol=2e-3, atol=0,
                                   msg=lambda m, name=name: f"{recipe} {name}: {m}")
        for param, spread in _spread(one, run).items():
            assert spread <= 0.15, (recipe, name, param, spread)


def test_cuda_dry_run_latent_attention_gemms_under_tp_are_fp8(capsys):
    """The fake-CUDA step of MLA under tp 2 + sp, tensorwise: every block GEMM float8 and the
    three bf16 ones the output layer's (main before MLA's linears went through ``tp_gemm``:
    33 bf16, its 5 linears x 3 GEMMs x 2 layers in bf16)."""
    argv = ["dry-run", "configs/debug.toml", "--world", "2", "--device", "cuda", "--json", "--set", "train.fp8=tensorwise",
            "--set", "train.dtype=bfloat16", "--set", "parallel.tp=2", "--set", "parallel.sp=true",
            "--set", "parallel.dp_shard=1"]
    assert main(argv + [x for k, v in _MLA.items() for x in ("--set", f"model.{k}={v}")]) == 0
    g = json.loads(capsys.readouterr().out)["gpu"]
    assert g["errors"] == [] and g["gemms"] == {"bfloat16": 3, "float8_e4m3fn": 16, "float8_e5m2": 32}, g["gemms"]


@pytest.mark.parametrize("parallel, recipes", [
    ({"dp_shard": 2, "ep": 2, "zero": 3}, ("none", "rowwise", "mxfp8")),
    ({"dp_shard": 2, "zero": 3}, ("none", "rowwise")),  # no ep: the gates enter the experts
], ids=["ep2", "dp2"])
def test_planner_prices_the_padded_expert_groups_of_fp8(tmp_path, parallel, recipes):
    """An fp8 recipe's grouped GEMM pads every expert's group to 16 rows (MXFP8 32) and the
    layout to a multiple of that (``GroupedExperts.group_rows``), on any device: the padded
    rows' activations (input, hidden, gated product) and each row's place. The dry-run (2
    fake ranks, 8 experts, top 3, 2 layers) and the planner differ from bf16 by exactly the
    same bytes: rowwise 84,992 with ep 2 (MXFP8, groups of 32: 166,912), 200,192 without.
    (MXFP8's linears save their weight wrapper's inner tensor: a parameter's storage, which
    the dry-run's count now recognises, ``memory._param_keys``.)"""
    from meshfold.dryrun import dry_run

    acts = {}
    for recipe in recipes:
        cfg = tiny_config(str(tmp_path / recipe), parallel=parallel,
                          train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "fp8": recipe})
        cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, **_MOE, "moe_experts": 8, "moe_topk": 3})
        out = dry_run(from_dict(cfg), 2, cluster="h100")
        acts[recipe] = (out["runtime"]["activation_bytes"], out["planner"]["activation_bytes"])
        assert acts[recipe][1] == pytest.approx(acts[recipe][0], rel=0.10), (recipe, acts)
    (rt, pl) = acts["none"]
    for recipe in recipes[1:]:
        rt8, pl8 = acts[recipe]
        assert rt8 - rt == pl8 - pl > 0, (recipe, acts)
