"""``meshfold btm``: Branch-Train-Merge (Li et al. 2022, "Branch-Train-Merge: Embarrassingly
Parallel Training of Expert Language Models").

    meshfold btm branch SEED_CKPT --domain NAME=SOURCE ... --out DIR [--config BASE.toml] [--set k=v]
    meshfold train DIR/NAME/config.toml ...          (each branch: any layout, any machine, any time)
    meshfold btm merge DIR --out CKPT [--weights NAME=W ...] [--ensemble]
    meshfold btm eval DIR [--model LABEL=CKPT ...] [--ensemble CKPT] [--json]

``branch`` writes one run per domain: DIR/NAME/config.toml starts from the seed
(``train.init_from``), trains on its own ``data.source`` into DIR/NAME/run, and every
branch shares one tokenizer (DIR/tokenizer.json, the seed's), so branches can be averaged
and ensembled. ``SOURCE`` is any ``data.source``, or ``default:K/N``: the K-th of N
contiguous, disjoint parts of the default corpus (written to DIR/NAME/domain.jsonl).

``merge`` reads each branch's newest checkpoint. Averaged: a model-only checkpoint (what
``train.init_from`` and ``convert export`` read) of sum_i w_i theta_i, read one tensor at a
time from every branch, so one model's worth is held. ``--ensemble``: CKPT/members/NAME
(each a model-only checkpoint) and CKPT/ensemble.json with the prior weights. An
ensemble's evaluation weights its members by the domain posterior of the input: on the
first ``posterior_batches`` batches, p(j | x) ∝ prior_j · p_j(x) per sequence, averaged
over those sequences (BTM's cached prior); the loss is then -log sum_j w_j p_j(token).

``eval`` prints the per-domain validation loss of every branch, of extra models (the merge,
a dense baseline) and of an ensemble, on each domain's held-out documents (the sequences
and batch count the trainer's own validation uses), and writes DIR/btm_eval.json.

Evaluation runs in one process on whole models (what this tool is for: the debug-to-small
shapes of an ablation); the branches themselves train with any layout.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from meshfold.config import Config, dump_toml, load_config, validate
from meshfold.convert import copy_tokenizer, load_model, write_checkpoint_model
from meshfold.data.dataset import IGNORE_INDEX, GlobalBatchSampler, build_data
from meshfold.data.sources import load_documents
from meshfold.data.tokenizer import get_tokenizer
from meshfold.errors import ConfigError
from meshfold.models.config import ModelConfig
from meshfold.train.checkpoint_files import (CheckpointError, published, read_dcp_metadata, safe_load,
                                             validate_checkpoint)

PLAN = "btm.json"
ENSEMBLE = "ensemble.json"
TOKENIZER = "tokenizer.json"


# --------------------------------------------------------------------------- branch


def parse_pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{flag} {item!r}: expected NAME=VALUE")
        if name in out:
            raise ConfigError(f"{flag}: {name!r} given twice")
        out[name] = value
    return out


def _default_part(spec: str, cfg: Config, dst: Path) -> str:
    """``default:K/N``: documents [K·D/N, (K+1)·D/N) of the default corpus, as a .jsonl."""
    try:
        k, n = (int(x) for x in spec[len("default:"):].split("/"))
    except ValueError:
        raise ConfigError(f"--domain source {spec!r}: write default:K/N, e.g. default:0/4") from None
    if not 0 <= k < n:
        raise ConfigError(f"--domain source {spec!r}: K must be in [0, N)")
    data = copy.deepcopy(cfg.data)
    data.source = "default"
    docs = load_documents(data)  # the first data.max_docs of them when set
    part = docs[k * len(docs) // n:(k + 1) * len(docs) // n]
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w") as f:
        for doc in part:
            f.write(json.dumps({"text": doc}) + "\n")
    return str(dst.resolve())


def _absolute_source(source: str) -> str:
    """A path source as an absolute path: the branch's config is trained from any folder."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def _shared_tokenizer(cfg: Config, seed: Path, out: Path) -> Path:
    """The seed's tokenizer as DIR/tokenizer.json: the seed checkpoint's own file, else the
    base config's ``data.tokenizer``, else the BPE its data source trains (and caches)."""
    dst = out / TOKENIZER
    if (seed / TOKENIZER).is_file():
        shutil.copyfile(seed / TOKENIZER, dst)
    elif cfg.data.tokenizer:
        copy_tokenizer(Path(cfg.data.tokenizer).expanduser(), out)
    else:
        tok = get_tokenizer("", load_documents(cfg.data), cfg.model.vocab_size, cfg.data.cache_dir)
        dst.write_text(tok.to_str())
    return dst.resolve()


def _seed_config(seed: Path, base: str | None, overrides: list[str]) -> Config:
    """The base config: ``--config``, else the seed's run (RUN_DIR/config.toml above
    RUN_DIR/checkpoints/step-N), else the seed checkpoint's own config.toml."""
    if base is None:
        for cand in (seed.parent.parent / "config.toml", seed / "config.toml"):
            if cand.is_file():
                base = str(cand)
                break
    if base is None:
        raise ConfigError(f"btm branch: no config.toml beside {seed}; give --config BASE.toml")
    return load_config(base, overrides)


def branch(seed: Path, domains: dict[str, str], out: Path, base: str | None = None,
           overrides: list[str] = ()) -> list[Path]:
    """One run directory per domain, seeded from ``seed``; returns the configs written."""
    seed = Path(seed).resolve()
    try:
        manifest = validate_checkpoint(seed)
    except CheckpointError as err:
        raise ConfigError(f"btm branch: {err}") from None
    if not domains:
        raise ConfigError("btm branch: give at least one --domain NAME=SOURCE")
    cfg = _seed_config(seed, base, list(overrides))
    cfg.model = ModelConfig(**manifest["model"])
    out.mkdir(parents=True, exist_ok=True)
    tok = _shared_tokenizer(cfg, seed, out)
    written = []
    for name, source in domains.items():
        run = out / name
        run.mkdir(parents=True, exist_ok=True)
        c = copy.deepcopy(cfg)
        c.data.source = (_default_part(source, cfg, run / "domain.jsonl") if source.startswith("default:")
                         else _absolute_source(source))
        c.data.mix_sources, c.data.mix_weights = [], []
        c.data.tokenizer = str(tok)
        c.train.init_from, c.train.run_dir = str(seed), str((run / "run").resolve())
        validate(c)
        (run / "config.toml").write_text(f"# btm branch {name!r} of {seed}\n" + dump_toml(c))
        written.append(run / "config.toml")
    (out / PLAN).write_text(json.dumps({"seed": str(seed), "domains": domains, "tokenizer": str(tok)}, indent=1))
    return written


# --------------------------------------------------------------------------- merge


def read_plan(folder: Path) -> dict:
    path = Path(folder) / PLAN
    if not path.is_file():
        raise ConfigError(f"{folder} has no {PLAN}; make it with `meshfold btm branch`")
    return json.loads(path.read_text())


def branch_checkpoints(folder: Path) -> dict[str, Path]:
    """Each branch's newest published checkpoint."""
    out = {}
    for name in read_plan(folder)["domains"]:
        found = published(Path(folder) / name / "run" / "checkpoints")
        if not found:
            raise ConfigError(f"btm: branch {name!r} has no checkpoint in {folder / name / 'run'}; "
                              f"train it: meshfold train {folder / name / 'config.toml'}")
        out[name] = found[0]
    return out


def branch_weights(names: list[str], given: dict[str, str]) -> dict[str, float]:
    unknown = set(given) - set(names)
    if unknown:
        raise ConfigError(f"--weights: no branch {sorted(unknown)}; branches are {names}")
    w = {n: float(given.get(n, 1.0)) for n in names}
    if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ConfigError("--weights: weights must be >= 0 with a positive sum")
    total = sum(w.values())
    return {n: v / total for n, v in w.items()}


def _model_meta(ckpt: Path) -> tuple[ModelConfig, dict]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest = validate_checkpoint(ckpt)
    meta = read_dcp_metadata(ckpt).state_dict_metadata
    return ModelConfig(**manifest["model"]), {k[len("model."):]: v for k, v in meta.items()
                                              if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def average(ckpts: dict[str, Path], weights: dict[str, float]) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """sum_i w_i theta_i over the branches, read one tensor of every branch at a time
    (float64 accumulation, stored in the branches' dtype)."""
    metas = {n: _model_meta(p) for n, p in ckpts.items()}
    first = next(iter(metas.values()))
    for n, (m, meta) in metas.items():
        if m != first[0] or {k: tuple(v.size) for k, v in meta.items()} != {k: tuple(v.size) for k, v in first[1].items()}:
            raise ConfigError(f"btm merge: branch {n!r} has another model shape than the others")
    out = {}
    for name, v in first[1].items():
        acc = torch.zeros(tuple(v.size), dtype=torch.float64)
        for n, p in ckpts.items():
            t = torch.empty(tuple(v.size), dtype=v.properties.dtype)
            safe_load({"model": {name: t}}, p, no_dist=True)
            acc += weights[n] * t.double()
        out[name] = acc.to(v.properties.dtype)
    return out, first[0]


def merge(folder: Path, out: Path, weights: dict[str, str] | None = None, ensemble: bool = False) -> dict:
    folder = Path(folder)
    ckpts = branch_checkpoints(folder)
    w = branch_weights(list(ckpts), weights or {})
    if not ensemble:
        state, m = average(ckpts, w)
        write_checkpoint_model(state, m, out, f"btm merge of {folder} ({w})", source_dir=folder)
        return {"merged": str(out), "weights": w}
    out.mkdir(parents=True, exist_ok=True)
    members = {}
    for n, p in ckpts.items():
        state, m = average({n: p}, {n: 1.0})
        write_checkpoint_model(state, m, out / "members" / n, f"btm branch {n} of {folder}", source_dir=folder)
        members[n] = f"members/{n}"
    spec = {"members": members, "prior": w, "posterior_batches": 1}
    (out / ENSEMBLE).write_text(json.dumps(spec, indent=1))
    return {"ensemble": str(out), **spec}


# --------------------------------------------------------------------------- evaluation


def domain_batches(folder: Path, cfg: Config, source: str) -> list[dict]:
    """The held-out batches of one domain, as the trainer's validation draws them."""
    c = copy.deepcopy(cfg)
    c.data.source, c.data.mix_sources, c.data.mix_weights = source, [], []
    val = build_data(c.data, c.model.vocab_size, c.model.seq_len).val
    if val is None:
        raise ConfigError(f"btm eval: domain source {source!r} holds no validation documents "
                          f"(data.val_docs = {c.data.val_docs})")
    sampler = GlobalBatchSampler(len(val), min(c.train.global_batch, len(val)), seed=12345)
    return [val.batch(sampler.next()) for _ in range(c.train.eval_batches)]


def _log_probs(model, batch: dict, doc_mask: bool) -> torch.Tensor:
    """Per-token log-probability of the labels, [batch, seq] (0 where ignored)."""
    logits = model(batch["inputs"], positions=batch.get("positions"),
                   doc_ids=batch.get("doc_ids") if doc_mask else None).double()
    labels = batch["labels"]
    lp = -F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none").view(labels.shape)
    return lp


@torch.no_grad()
def model_loss(model, batches: list[dict], doc_mask: bool) -> float:
    total = tokens = 0.0
    for b in batches:
        total -= _log_probs(model, b, doc_mask).sum().item()
        tokens += (b["labels"] != IGNORE_INDEX).sum().item()
    return total / tokens


@torch.no_grad()
def ensemble_loss(models: dict, prior: dict[str, float], batches: list[dict], doc_mask: bool,
                  posterior_batches: int = 1) -> tuple[float, dict[str, float]]:
    """(loss, weights): weights = the mean per-sequence posterior p(j | x) ∝ prior_j p_j(x)
    over the first ``posterior_batches`` batches; loss = -log sum_j w_j p_j(token) over all."""
    names = list(models)
    lps = [[_log_probs(models[n], b, doc_mask) for n in names] for b in batches]
    log_prior = torch.tensor([math.log(max(prior[n], 1e-300)) for n in names], dtype=torch.float64)
    post = []
    for per in lps[:max(1, posterior_batches)]:
        seq = torch.stack([lp.sum(1) for lp in per], 1)  # [sequences, members]
        post.append(torch.softmax(seq + log_prior, 1))
    w = torch.cat(post).mean(0)
    total = tokens = 0.0
    for b, per in zip(batches, lps):
        mix = torch.logsumexp(torch.stack(per, 0) + w.clamp_min(1e-300).log().view(-1, 1, 1), 0)
        mask = b["labels"] != IGNORE_INDEX
        total -= mix[mask].sum().item()
        tokens += mask.sum().item()
    return total / tokens, {n: float(x) for n, x in zip(names, w)}


def load_checkpoint(ckpt: Path):
    """A whole ``Transformer`` in the dtype the checkpoint holds, in eval mode."""
    meta = _model_meta(Path(ckpt))[1]
    return load_model(Path(ckpt), next(iter(meta.values())).properties.dtype).eval()


def load_ensemble(path: Path) -> tuple[dict, dict[str, float], int]:
    path = Path(path)
    if not (path / ENSEMBLE).is_file():
        raise ConfigError(f"{path} has no {ENSEMBLE}; make it with `meshfold btm merge DIR --ensemble --out {path}`")
    spec = json.loads((path / ENSEMBLE).read_text())
    models = {n: load_checkpoint(path / rel) for n, rel in spec["members"].items()}
    return models, spec["prior"], int(spec.get("posterior_batches", 1))


def evaluate(folder: Path, extra: dict[str, str] | None = None, ensemble: Path | None = None) -> dict:
    """Per-domain validation loss of every branch, every ``extra`` checkpoint and the
    ``ensemble``; also each row's mean over the domains."""
    folder = Path(folder)
    plan = read_plan(folder)
    cfgs = {n: load_config(folder / n / "config.toml") for n in plan["domains"]}
    first = next(iter(cfgs.values()))
    doc_mask = first.data.pack and first.data.doc_mask
    batches = {n: domain_batches(folder, first, c.data.source) for n, c in cfgs.items()}
    rows: dict[str, dict[str, float]] = {}
    models = {f"branch {n}": p for n, p in branch_checkpoints(folder).items()}
    models.update(extra or {})
    for label, ckpt in models.items():
        model = load_checkpoint(Path(ckpt))
        rows[label] = {d: model_loss(model, b, doc_mask) for d, b in batches.items()}
    posteriors = {}
    if ensemble is not None:
        members, prior, k = load_ensemble(ensemble)
        rows["ensemble"] = {}
        for d, b in batches.items():
            rows["ensemble"][d], posteriors[d] = ensemble_loss(members, prior, b, doc_mask, k)
    for row in rows.values():
        row["mean"] = sum(row.values()) / len(row)
    result = {"domains": list(plan["domains"]), "val_loss": rows, "ensemble_weights": posteriors}
    (folder / "btm_eval.json").write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    cols = result["domains"] + ["mean"]
    lines = ["| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, row in result["val_loss"].items():
        lines.append(f"| {label} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def run(args) -> int:
    try:
        if args.btm_command == "branch":
            written = branch(Path(args.seed), parse_pairs(args.domain, "--domain"), Path(args.out), args.config,
                             args.set)
            for path in written:
                print(f"meshfold: branch {path.parent.name}: meshfold train {path}")
            return 0
        if args.btm_command == "merge":
            out = merge(Path(args.folder), Path(args.out), parse_pairs(args.weights, "--weights"), args.ensemble)
            print(json.dumps(out))
            return 0
        result = evaluate(Path(args.folder), parse_pairs(args.model, "--model"),
                          Path(args.ensemble) if args.ensemble else None)
        print(json.dumps(result) if args.json else format_table(result))
        return 0
    except (ConfigError, CheckpointError) as err:
        print(f"meshfold: error: {err}", file=sys.stderr)
        return 2
