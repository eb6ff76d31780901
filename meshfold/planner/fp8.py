"""The bytes fp8 takes off the wire, for the planner (``train.fp8_all_gather``,
``parallel.ep_fp8_dispatch``; the runtime is ``parallel/fp8/``):

* FSDP2 gathers each converted linear's weight in fp8 (1 byte an element) where the other
  parameters of its block cross in the gather dtype; the output layer, the embeddings, the
  norms and the routed experts (their own FSDP group) are not converted;
* the expert dispatch sends each routed row as e4m3 values (1 byte each) and one fp32 scale.

Which linears are converted is the runtime's rule (``parallel/fp8/config.converts``)."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.parallel.fp8.config import converts
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


def dispatch_row_bytes(w: Workload, act: int, h: float) -> float:
    """Bytes of one routed row in the dispatch all-to-all: ``h`` values in the compute dtype,
    or in fp8 with a 4-byte scale (``parallel.ep_fp8_dispatch``)."""
    return h + 4 if w.fp8_dispatch else act * h
