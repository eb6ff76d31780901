"""Data pipeline: `meshfold prepare` throughput against today's one-process in-memory
tokenisation, and training start-up (time to first step, resident memory) on a small vs
a large prepared dataset; plus how much of a step waits for data with and without the
background prefetch. All in one run, so the ratios compare like with like.

1. Throughput. A corpus of COPIES copies of the default corpus (this Python's standard
   library, ~4.7 MB each, default 2) as text files, and a byte-level BPE (vocab 4096) trained on one
   copy. Baseline: ``load_documents`` + ``tokenize_corpus`` (everything in memory, one
   process; the tokenizers library may use its own threads). Then ``meshfold prepare``
   with 1 worker (in-process) and 2 worker processes. Printed: MB/s, tokens/s, docs/s and
   each ratio to the baseline.
2. Start-up. Two prepared datasets written in the documented format (random tokens,
   lognormal document lengths): ~2M and ~100M tokens. For each, a fresh process imports
   meshfold, builds the Trainer (debug model) on it and runs one step; printed: seconds
   from the start of the Trainer to the end of step 1 (and, measured before it in the same
   process, the data part alone: opening the dataset, the sampler, the first batch), and
   the resident memory (VmRSS)
   after it (VmRSS, and its anonymous part RssAnon: the process's own memory, without the
   mapped file pages the kernel can drop), with their differences (goal: <= 3 s and
   <= 100 MB apart).
3. Prefetch. 10 steps on the large dataset with data.prefetch = 0 and = 2: mean step
   time and mean data_wait_s (time the step waited for its batch).

    .venv/bin/python benchmarks/data.py [--copies 2] [--large-tokens 100000000] [--repeats 3]
                                        [--parts throughput startup]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from meshfold.config import DataConfig  # noqa: E402
from meshfold.data.dataset import tokenize_corpus  # noqa: E402
from meshfold.data.prepare import prepare  # noqa: E402
from meshfold.data.prepared import FORMAT, TOKENIZER, VERSION, ShardWriter, write_manifest  # noqa: E402
from meshfold.data.sources import default_corpus_files, load_documents  # noqa: E402
from meshfold.data.tokenizer import train_bpe, tokenizer_sha256  # noqa: E402


def throughput(work: Path, copies: int, repeats: int) -> None:
    corpus = work / "corpus"
    for c in range(copies):
        d = corpus / f"copy{c}"
        d.mkdir(parents=True)
        for f in default_corpus_files():
            shutil.copy(f, d / f.name)
    nbytes = sum(f.stat().st_size for f in corpus.rglob("*") if f.is_file())
    tok = train_bpe(load_documents(DataConfig(source=str(corpus / "copy0"))), 4096)
    tok.save(str(work / "tokenizer.json"))
    methods = ["in-memory, 1 process (today)", "meshfold prepare --workers 1", "meshfold prepare --workers 2"]
    secs: dict[str, list[float]] = {k: [] for k in methods}
    counts = {}
    for r in range(repeats):  # rounds of all three, so machine noise hits each alike
        t = time.perf_counter()
        tc = tokenize_corpus(load_documents(DataConfig(source=str(corpus))), tok, str(work / f"cache{r}"))
        secs[methods[0]].append(time.perf_counter() - t)
        counts[methods[0]] = (tc.n_tokens, tc.n_docs)
        del tc
        for workers in (1, 2):
            out = work / f"prep{workers}-{r}"
            t = time.perf_counter()
            m = prepare([str(corpus)], str(work / "tokenizer.json"), out, workers=workers, progress=False)
            secs[methods[workers]].append(time.perf_counter() - t)
            counts[methods[workers]] = (m["tokens"], m["docs"])
            shutil.rmtree(out)
    base = statistics.median(secs[methods[0]])
    print(f"\n## prepare throughput: {nbytes / 1e6:.1f} MB of text, {counts[methods[0]][1]} documents, vocab 4096, "
          f"median of {repeats} rounds")
    print(f"{'method':34s} {'s':>7s} {'MB/s':>7s} {'Mtok/s':>7s} {'docs/s':>8s} {'vs today':>9s}  all rounds (s)")
    for name in methods:
        sec = statistics.median(secs[name])
        tokens, docs = counts[name]
        print(f"{name:34s} {sec:7.2f} {nbytes / 1e6 / sec:7.2f} {tokens / 1e6 / sec:7.3f} {docs / sec:8.0f} "
              f"{base / sec:8.2f}x  {', '.join(f'{x:.1f}' for x in secs[name])}")


def synthetic_prepared(out: Path, tokens: int, seed: int = 0, shard_tokens: int = 1 << 26) -> None:
    """A prepared dataset in the documented format: random tokens (vocab 512, EOS = 0),
    lognormal document lengths (median ~600 tokens), written shard by shard."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    shutil.copy(Path(os.environ["MESHFOLD_BENCH_TOK"]), out / TOKENIZER)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / TOKENIZER))
    m = {"format": FORMAT, "version": VERSION, "dtype": "uint16", "vocab_size": tok.get_vocab_size(), "eos_id": 0,
         "pad_id": 1, "tokenizer_sha256": tokenizer_sha256(tok), "text_field": "text", "max_docs": 0,
         "sources": [{"path": "synthetic", "bytes": 0, "sha256": ""}], "shards": [], "tokens": 0, "docs": 0,
         "complete": False}
    left = tokens
    while left > 0:
        w = ShardWriter(out, f"shard-{len(m['shards']):05d}", "uint16")
        while w.tokens < min(shard_tokens, left):
            lens = np.clip(rng.lognormal(6.4, 1.0, 4096).astype(np.int64), 2, 20000)
            lens = lens[np.cumsum(lens) <= max(min(shard_tokens, left) - w.tokens, int(lens[0]))]
            flat = rng.integers(2, 512, int(lens.sum()), dtype=np.uint16)
            ends = np.cumsum(lens) - 1
            flat[ends] = 0
            starts = np.concatenate([[0], ends[:-1] + 1])
            w.add([flat[s: e + 1] for s, e in zip(starts, ends)])
        s = w.finish()
        m["shards"].append(s)
        m["tokens"] += s["tokens"]
        m["docs"] += s["docs"]
        left -= s["tokens"]
    m["complete"] = True
    write_manifest(out, m)


PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from meshfold.config import load_config
from meshfold.train.trainer import Trainer
cfg = load_config("configs/debug.toml", [f"data.source={sys.argv[1]}", "train.progress=false", "train.steps=20",
                  "train.tensorboard=false", f"train.run_dir={sys.argv[2]}", f"data.prefetch={sys.argv[3]}",
                  "model.seq_len=128", "train.global_batch=16", "model.vocab_size=4096"])
from meshfold.data.dataset import build_data, make_sampler
t_import = time.perf_counter()
data = build_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)  # the data part alone: map, sample, read
data.train.batch(make_sampler(data.train, cfg.train.global_batch, cfg.train.seed).next())
t_data = time.perf_counter() - t_import
del data
t_import = time.perf_counter()
tr = Trainer(cfg)
tr.train_step()
t_first = time.perf_counter()
status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
          if l.startswith(("VmRSS", "RssAnon"))}
rss, anon = status["VmRSS"], status["RssAnon"]
steps, waits = [], []
for _ in range(int(sys.argv[4])):
    s = time.perf_counter()
    tr.train_step()
    steps.append(time.perf_counter() - s)
    waits.append(tr.step_metrics.pop("data_wait_s"))
tr.prefetcher.close()
print(json.dumps({"first_step_s": t_first - t_import, "data_s": t_data, "rss": rss, "anon": anon, "steps": steps, "waits": waits,
                  "tokens": tr.data.train.corpus.n_tokens}))
"""


def probe(source: Path, run_dir: Path, prefetch: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(source), str(run_dir), str(prefetch), str(steps)],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def startup(work: Path, small: int, large: int, repeats: int) -> None:
    os.environ["MESHFOLD_BENCH_TOK"] = str(work / "tokenizer.json")
    sets = {}
    for name, n in (("small", small), ("large", large)):
        t = time.perf_counter()
        synthetic_prepared(work / name, n, seed=len(name))
        sets[name] = work / name
        print(f"(wrote {name}: {n / 1e6:.0f}M tokens in {time.perf_counter() - t:.1f} s)")
    res = {k: [] for k in sets}
    for r in range(repeats):  # alternate so machine noise hits both
        for name, src in sets.items():
            res[name].append(probe(src, work / f"run-{name}-{r}", 2, 0))
    print("\n## training start-up on prepared datasets (debug model, seq_len 128, global batch 16)")
    med = {}
    for name, runs in res.items():
        med[name] = [statistics.median(x[k] for x in runs) for k in ("first_step_s", "rss", "anon", "data_s")]
        print(f"{name:6s} {runs[0]['tokens'] / 1e6:8.1f}M tokens  time to first step {med[name][0]:6.2f} s "
              f"(data alone {med[name][3]:5.2f} s)  "
              f"RSS {med[name][1] / 2**20:7.1f} MiB (anonymous {med[name][2] / 2**20:7.1f} MiB)  "
              f"(median of {repeats}; all: {', '.join('%.2f' % x['first_step_s'] for x in runs)} s)")
    print(f"difference large - small: {med['large'][0] - med['small'][0]:+.2f} s (data alone "
          f"{med['large'][3] - med['small'][3]:+.3f} s), RSS "
          f"{(med['large'][1] - med['small'][1]) / 2**20:+.1f} MiB, anonymous "
          f"{(med['large'][2] - med['small'][2]) / 2**20:+.1f} MiB  (goal: <= 3 s, <= 100 MB)")
    print("\n## step time vs data time, large dataset, 10 steps")
    for prefetch in (0, 2):
        x = probe(sets["large"], work / f"run-pf{prefetch}", prefetch, 10)
        print(f"data.prefetch={prefetch}: mean step {1e3 * statistics.mean(x['steps']):7.2f} ms, "
              f"mean wait for data {1e3 * statistics.mean(x['waits']):6.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--small-tokens", type=int, default=2_000_000)
    ap.add_argument("--large-tokens", type=int, default=100_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", nargs="+", default=["throughput", "startup"], choices=["throughput", "startup"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshfold-data-bench-") as tmp:
        work = Path(tmp)
        os.environ["MESHFOLD_CACHE"] = str(work / "cache")
        if "throughput" in args.parts:
            throughput(work, args.copies, args.repeats)
        if "startup" in args.parts:
            if not (work / "tokenizer.json").exists():
                train_bpe(load_documents(DataConfig()), 4096).save(str(work / "tokenizer.json"))
            startup(work, args.small_tokens, args.large_tokens, args.repeats)


if __name__ == "__main__":
    main()
