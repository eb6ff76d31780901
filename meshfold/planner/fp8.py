"""The bytes fp8 takes off the wire, for the planner (``train.fp8_all_gather``,
``parallel.ep_fp8_dispatch``; the runtime is ``parallel/fp8/``):

* FSDP2 gathers each converted linear's weight in fp8 (1 byte an element) where the other
  parameters of its block cross in the gather dtype; the output layer, the embeddings, the
  norms and the routed experts (their own FSDP group) are not converted;
* the expert dispatch sends each routed row as e4m3 values (1 byte each) and one fp32 scale.

Which linears are converted is the runtime's rule (``parallel/fp8/config.converts``)."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.parallel.fp8.config import ALIGN, converts
from meshfold.planner.attention import attention_terms
from meshfold.planner.workload import Workload


def block_linears(m: ModelConfig, moe: bool) -> list[tuple[float, float]]:
    """(out, in) of a block's linear weights, whole: the attention's, then the dense MLP's
    (a MoE block's: its shared experts', one MLP of their joint width; the router and the
    routed experts are no linears the recipes convert)."""
    f = m.moe_shared_experts * m.expert_dim if moe else m.hidden_dim
    mlp = ([(f, m.dim)] * (2 if m.gated_mlp else 1) + [(m.dim, f)]) if f else []
    return attention_terms(m).gemms(m, 1) + mlp


def fp8_gathered_params(w: Workload, layers: dict) -> float:
    """Parameters FSDP2 gathers in fp8 for ``layers`` ({is MoE: blocks}): 0 without
    ``fp8_all_gather`` (which needs tensorwise and tp 1)."""
    if not w.fp8_all_gather:
        return 0.0
    return sum(n * sum(o * i for o, i in block_linears(w.model, moe) if converts("tensorwise", "", int(i), int(o)))
               for moe, n in layers.items())


def expert_group_rows(w: Workload) -> int:
    """The rows each routed expert's group is padded to (``GroupedExperts.group_rows``): the
    recipe's alignment where its grouped GEMM runs the experts (``parallel/fp8/experts.py``:
    both expert widths multiples of it), else 1."""
    m, align = w.model, ALIGN.get(w.fp8_recipe, 1)
    return align if w.fp8 and m.moe_experts and m.dim % align == 0 and m.expert_dim % align == 0 else 1


def dispatch_row_bytes(w: Workload, act: int, h: float) -> float:
    """Bytes of one routed row in the dispatch all-to-all: ``h`` values in the compute dtype,
    or in fp8 with a 4-byte scale (``parallel.ep_fp8_dispatch``)."""
    return h + 4 if w.fp8_dispatch else act * h


# The amax all-reduces over tp of one converted linear's forward and backward
# (``parallel/fp8/tp.py``: a cast's scale is reduced where the axis it spans is split), by
# recipe and split; each entry the length of the reduced amax: "1" a scalar, "tokens" one
# per token, "in"/"out" one per input/output feature of the whole weight. fp32 each.
# "replicated" (MLA's down-projections): under sp only, where their tokens are split.
TP_AMAX = {
    "tensorwise": {"column": (["1"], ["1", "1", "1"]), "row": (["1", "1"], ["1", "1"]),
                   "replicated": (["1"], ["1", "1", "1"])},
    "rowwise": {"column": ([], ["tokens", "in"]), "row": (["tokens", "out"], []), "replicated": ([], ["out", "in"])},
    "rowwise_with_gw_hp": {"column": ([], ["tokens", "1"]), "row": (["tokens", "out"], ["1"]),
                           "replicated": ([], [])},
}


def _tp_linears(m: ModelConfig, moe: bool) -> list[tuple[str, float, float, str | None]]:
    """(split, out, in, sp column group) of the block linears tensor parallel runs through
    ``tp_gemm``: the attention's (GQA's q, k, v and o; MLA's down-projections, up-projections
    and o), the dense MLP's (or shared experts') w1, w3 and w2."""
    shapes = block_linears(m, moe)
    attention = len(attention_terms(m).gemms(m, 1))
    splits = attention_terms(m).tp_splits(m)  # (the kind's tp layer: which linears, how split)
    splits += [("column", "mlp")] * (len(shapes) - attention - 1) + [("row", None)] if len(shapes) > attention else []
    return [(s, o, i, g) for (s, g), (o, i) in zip(splits, shapes) if s is not None]


def tp_amax_collectives(w: Workload, tp: int, layers: dict, tokens: float, recompute: str,
                        sp: bool = False) -> tuple[float, float]:
    """(calls, payload bytes) of one micro-batch's amax all-reduces over tp for ``layers``
    ({is MoE: blocks}) under ``w.fp8_recipe``; the forward's again under full or op recompute."""
    recipe = w.fp8_recipe
    table = TP_AMAX.get(recipe)
    if table is None or tp == 1:
        return 0.0, 0.0
    forwards = 2 if recompute in ("full", "op") else 1
    calls = sent = 0.0
    for moe, n in layers.items():
        for split, o, i, _ in _tp_linears(w.model, moe):
            if not converts(recipe, "", int(i), int(o), tp) or (split == "replicated" and not sp):
                continue
            size = {"1": 1, "tokens": tokens, "in": i, "out": o}
            fwd, bwd = table[split]
            calls += n * (forwards * len(fwd) + len(bwd))
            sent += n * 4 * (forwards * sum(size[k] for k in fwd) + sum(size[k] for k in bwd))
    return calls, sent


def sp_regathers_skipped(w: Workload, tp: int, sp: bool, layers: dict, tokens: float, act: int) -> tuple[float, float]:
    """(calls, bytes before the ring factor) of the sequence-parallel all-gathers fp8 does
    not issue per micro-batch: a column group (q, k, v or MLA's full-rank q; w1, w3) with a
    converted linear keeps its gathered input for backward (its fp8 GEMMs save their own
    inputs) instead of gathering it again there, as ``_GatheredLinears`` does for bf16 ones."""
    if not (sp and tp > 1 and w.fp8):
        return 0.0, 0.0
    calls = 0.0
    for moe, n in layers.items():
        groups: dict[str, bool] = {}
        for split, o, i, group in _tp_linears(w.model, moe):
            if group is not None:
                groups[group] = groups.get(group, False) or converts(w.fp8_recipe, "", int(i), int(o), tp)
        calls += n * sum(groups.values())
    return calls, calls * tokens * w.model.dim * act


def sp_inputs_kept(w: Workload, tp: int, sp: bool, moe: bool, tokens: float, act: int) -> float:
    """Activation bytes one block of kind ``moe`` keeps beyond bf16's under sp: a column group
    with a converted linear keeps its gathered input (``tokens`` x dim, the compute dtype:
    torchao's ``matmul_with_hp_or_float8_args`` and ``parallel/fp8/tp.py`` save the
    high-precision input, cast again to fp8 in backward) where ``_GatheredLinears`` keeps
    only this rank's 1/tp of it and gathers it again. That 1/tp stays kept anyway where a
    replicated linear reads the same input (MLA's down-projections beside a full-rank q)."""
    if not (sp and tp > 1 and w.fp8):
        return 0.0
    linears = _tp_linears(w.model, moe)
    converted = {g for s, o, i, g in linears if g is not None and converts(w.fp8_recipe, "", int(i), int(o), tp)}
    shares_input = any(s == "replicated" for s, *_ in linears)  # (only attention linears are replicated)
    return sum(act * tokens * w.model.dim * (1 if group == "attention" and shares_input else 1 - 1 / tp)
               for group in converted)
