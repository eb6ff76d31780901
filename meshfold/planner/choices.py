"""Config keys the planner's search may choose: a key set to ``"auto"`` (``train.optimizer``,
``train.fp8``) is priced with every value of its ``Choice`` and all the layouts ranked
together (fitting layouts first, then by step time; among equal times the earlier value, so
the plainer one: AdamW, no fp8). Each estimate names the values it was priced with
(``Estimate.choices``), which ``meshfold plan`` prints and writes into ``--out``. A new
choosable key is one ``Choice`` here. Only ``meshfold plan`` resolves ``auto``: pricing one
given layout (``simulate``, the dry-run's planner column) or training refuses it in one line.

The planner prices a step, not what a step buys: Muon's better loss per token and fp8's
numerics are not priced; fp8 wins where its GEMMs save more than its casts cost, which
depends on ``train.compile`` (eager casts run op by op: docs/gpu.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from meshfold.errors import ConfigError
from meshfold.planner.workload import Workload

AUTO = "auto"


@dataclass(frozen=True)
class Choice:
    key: str  # the config key, e.g. "train.fp8"
    field: str  # the Workload field that holds it
    values: tuple[str, ...]  # what the search tries, plainest first
    priced: Callable[[Workload, str], Workload]  # the workload priced with one value


def _with_fp8(w: Workload, recipe: str) -> Workload:
    # the FSDP2 fp8 gathers go with tensorwise only (parallel/fp8/config.py)
    return dataclasses.replace(w, fp8_recipe=recipe, fp8=recipe != "none",
                               fp8_all_gather=w.fp8_all_gather and recipe == "tensorwise")


CHOICES = (
    Choice("train.optimizer", "optimizer", ("adamw", "muon"), lambda w, v: dataclasses.replace(w, optimizer=v)),
    # rowwise is priced as tensorwise (its scales' cost is not modelled): tensorwise stands for fp8
    Choice("train.fp8", "fp8_recipe", ("none", "tensorwise"), _with_fp8),
)


def open_choice(w: Workload) -> Choice | None:
    """The first key of ``w`` left to the search (``auto``), if any."""
    return next((c for c in CHOICES if getattr(w, c.field) == AUTO), None)


def refuse_open_choices(w: Workload) -> None:
    """Pricing one layout needs every value given: ``auto`` is ``meshfold plan``'s to resolve."""
    choice = open_choice(w)
    if choice is not None:
        raise ConfigError(f"{choice.key} = auto: only `meshfold plan` chooses it; set it to one of "
                          f"{', '.join(choice.values)} to price a given layout")


def search_each(search, w: Workload, cluster, **options):
    """``search`` (planner/search.py) once per value of ``w``'s first open choice (the others,
    if any, are opened by the calls in turn) and one ranking of them all."""
    choice = open_choice(w)
    results = []
    for value in choice.values:
        res = search(choice.priced(w, value), cluster, **options)
        for e in res.ranked:
            e.choices = {choice.key: value, **e.choices}
        results.append(res)
    any_fits = any(r.any_fits for r in results)
    order = {value: k for k, value in enumerate(choice.values)}
    ranked = sorted((e for r in results for e in r.ranked if e.fits or not any_fits),
                    key=lambda e: (e.step_time_s, order[e.choices[choice.key]]))[: options.get("top", 10)]
    notes = [n for r in results for n in r.notes if r.any_fits == any_fits and "= auto:" not in n][:1]
    if ranked:
        value = ranked[0].choices[choice.key]
        winner = results[order[value]]  # the inner choices' notes of the search that won
        notes += [n for n in winner.notes if "= auto:" in n]
        notes.append(f"{choice.key} = auto: {value} (the fastest layout " + ("that fits" if any_fits else "of all")
                     + " over " + " | ".join(choice.values) + ")")
    first = results[0]
    return dataclasses.replace(first, ranked=ranked, any_fits=any_fits, notes=notes,
                               evaluated=sum(r.evaluated for r in results),
                               structures=sum(r.structures for r in results),
                               visited=sum(r.visited for r in results), seconds=sum(r.seconds for r in results))
