"""The planner split by concern: attention kinds behind a registry, multi-token prediction
as arithmetic over its depth, typed layer terms, no planner module over 500 lines."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshfold.models.presets import preset
from meshfold.planner import mtp
from meshfold.planner.attention import VARIANTS, AttentionTerms, attention_terms
from meshfold.planner.attention.gqa import GroupedQuery
from meshfold.planner.attention.mla import LatentAttention
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import CostModel, Layout, Workload
from meshfold.planner.kernels import layer_gemms
from meshfold.planner.terms import BlockTerms, LayerTerms, TpCalls


def test_attention_kind_is_looked_up_by_the_config():
    assert isinstance(attention_terms(preset("llama3-8b")), GroupedQuery)
    assert isinstance(attention_terms(preset("deepseek-v3")), LatentAttention)
    assert set(VARIANTS) >= {"gqa", "mla"}


def test_a_new_attention_kind_plugs_in_with_one_registration(monkeypatch):
    class Wider(GroupedQuery):
        def gemms(self, m, tp):
            return [(2 * x, k) for x, k in super().gemms(m, tp)]

    m = preset("llama3-8b")
    base = layer_gemms(m, 2, False)
    monkeypatch.setitem(VARIANTS, "gqa", Wider())
    assert layer_gemms(m, 2, False)[:4] == [(2 * x, k) for x, k in base[:4]]
    assert layer_gemms(m, 2, False)[4:] == base[4:]
    assert issubclass(Wider, AttentionTerms)


def test_mtp_terms_vanish_without_depth():
    m = preset("llama3-8b")
    cm = CostModel(Workload(m, global_batch=32), load_cluster("h100", devices=16))
    T = cm.layer_terms(2, False, 1, "ring", 1, 1, "none")
    assert mtp.heads_terms(m, T, 4) == (0.0, 0.0, 0.0)
    assert mtp.saved_logits(m, 123.5, 2, True, 4096) == 123.5
    assert mtp.head_kinds(m, cm.kinds) == [] and mtp.embedding_exchanges(m, False) == 0
    deep = dataclasses.replace(m, mtp_depth=2)
    assert mtp.extra_params(deep, 4, 10.0) == 2 * (2 * m.dim ** 2 + 3 * m.dim) + 10.0
    assert mtp.heads_on(deep, True) == 2 and mtp.heads_on(deep, False) == 0


def test_layer_terms_are_typed():
    cm = CostModel(Workload(preset("mixtral-8x7b"), global_batch=64), load_cluster("h100", devices=64))
    T = cm.layer_terms(2, True, 1, "ring", 4, 1, "selective", 0, 2)
    assert isinstance(T, LayerTerms) and all(isinstance(b, BlockTerms) for b in T.kinds.values())
    assert isinstance(T.traffic.tp_layer, TpCalls) and T.traffic.tp_moe.calls > 0
    assert T.params.expert_p > 0 and T.time.tp_ar > 0 and T.acts.act_kinds[True] > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        T.tokens = 0
    est = cm.estimate(Layout(dp_shard=8, tp=2, sp=True, pp=4, ep=4, micro_batch=1, recompute="selective",
                             ep_overlap_chunks=2))
    assert est.step_time_s > 0 and est.collectives["ep"]["count"] > 0


def test_no_planner_module_over_500_lines():
    root = Path(__file__).resolve().parents[1] / "meshfold" / "planner"
    sizes = {p.relative_to(root).as_posix(): p.read_text().count("\n") for p in root.rglob("*.py")}
    assert max(sizes.values()) <= 500, sizes
