"""`meshfold prepare` and training from prepared (memory-mapped, sharded) datasets:
the same sequences and losses as the in-memory path, exact mixtures, exact resume, the
same batches for any data-parallel layout, and one clear line for each bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from meshfold.cli import main
from meshfold.config import ConfigError, DataConfig, from_dict
from meshfold.data.dataset import (SequenceDataset, build_data, make_sampler, prepared_corpus,
                                   rank_slice, tokenize_corpus)
from meshfold.data.loader import peek
from meshfold.data.mixture import MixtureSampler
from meshfold.data.prepare import prepare
from meshfold.data.prepared import open_shards, read_manifest
from meshfold.data.sources import load_documents
from meshfold.data.tokenizer import get_tokenizer
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    """Real text (the default corpus's first 60 documents) as a JSONL file and a folder of
    text files, with a BPE tokenizer trained on them."""
    root = tmp_path_factory.mktemp("raw")
    docs = load_documents(DataConfig(max_docs=60))
    tok = get_tokenizer("", docs, 320, str(root / "cache"))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    with (root / "a.jsonl").open("w") as fh:
        for i, d in enumerate(docs[:30]):
            fh.write(json.dumps({"id": i, "text": d}) + "\n")
    (root / "b").mkdir()
    for i, d in enumerate(docs[30:]):
        (root / "b" / f"{i:03d}.txt").write_text(d)
    return {"root": root, "docs": docs, "tok": tok, "tokfile": str(root / "tok" / "tokenizer.json")}


@pytest.fixture(scope="module")
def prepared(corpus_files, tmp_path_factory):
    """Both sources prepared into one dataset (several small shards), and each alone."""
    root, tokdir = tmp_path_factory.mktemp("prep"), str(corpus_files["root"] / "tok")
    raw = corpus_files["root"]
    both, a, b = root / "both", root / "a", root / "b"
    assert main(["prepare", str(raw / "a.jsonl"), str(raw / "b"), "--tokenizer", tokdir, "--out", str(both),
                 "--shard-tokens", "200000", "--quiet"]) == 0
    assert main(["prepare", str(raw / "a.jsonl"), "--tokenizer", tokdir, "--out", str(a), "--quiet"]) == 0
    assert main(["prepare", str(raw / "b"), "--tokenizer", tokdir, "--out", str(b), "--quiet"]) == 0
    return {"both": both, "a": a, "b": b}


def _shard_bytes(folder) -> list[bytes]:
    return [(folder / f"{s['name']}.bin").read_bytes() + (folder / f"{s['name']}.idx").read_bytes()
            for s in read_manifest(folder)["shards"]]


# --------------------------------------------------------------------------- prepare


def test_prepare_matches_in_memory_tokenisation(corpus_files, prepared):
    m = read_manifest(prepared["both"])
    assert m["complete"] and m["dtype"] == "uint16" and len(m["shards"]) >= 3  # crosses shard boundaries
    assert [s["path"].endswith(".jsonl") for s in m["sources"]][0] and len(m["sources"]) == 31
    ref = tokenize_corpus(corpus_files["docs"], corpus_files["tok"])
    assert m["docs"] == ref.n_docs == 60 and m["tokens"] == ref.n_tokens
    corpus, _ = prepared_corpus(prepared["both"], None, 320)
    assert all(isinstance(s.tokens, np.memmap) and isinstance(s.offsets, np.memmap) for s in corpus.shards)
    np.testing.assert_array_equal(corpus.read(0, corpus.n_tokens), ref.read(0, ref.n_tokens))
    np.testing.assert_array_equal(corpus.offsets, ref.offsets)


def test_two_workers_write_the_same_bytes(corpus_files, prepared, tmp_path):
    raw = corpus_files["root"]
    prepare([str(raw / "a.jsonl"), str(raw / "b")], corpus_files["tokfile"], tmp_path / "w2", workers=2,
            shard_tokens=200000, progress=False)
    assert _shard_bytes(tmp_path / "w2") == _shard_bytes(prepared["both"])


def test_prepared_windows_and_doc_ids_equal_in_memory(corpus_files, prepared):
    ref = tokenize_corpus(corpus_files["docs"], corpus_files["tok"])
    corpus, _ = prepared_corpus(prepared["both"], None, 320)
    for pack in (True, False):
        for sub in (range(0, 55), range(55, 60)):  # train / validation views
            a = SequenceDataset(ref.subset(sub), 48, pack)
            b = SequenceDataset(corpus.subset(sub), 48, pack)
            assert len(a) == len(b)
            idx = list(range(len(a)))
            for key, value in a.batch(idx).items():
                torch.testing.assert_close(b.batch(idx)[key], value, rtol=0, atol=0)
    # doc_ids from the offsets equal a per-token document array (the old way), shard seams included
    per_token = np.repeat(np.arange(ref.n_docs), ref.doc_lengths())
    for start in range(0, ref.n_tokens - 300, 997):
        np.testing.assert_array_equal(corpus.doc_ids(start, start + 300), per_token[start: start + 300])


def _trainer_losses(cfg_dict, swap_data=None):
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    if swap_data is not None:  # the in-memory reference: same tokens, numpy arrays instead of memory maps
        tr.data = swap_data
        tr.sampler = make_sampler(tr.data.train, tr.cfg.train.global_batch, tr.cfg.train.seed)
    return tr.fit()


def test_training_on_prepared_equals_in_memory(corpus_files, prepared, tmp_path):
    cfg = tiny_config(str(tmp_path / "p"), data={"source": str(prepared["both"]), "max_docs": 0, "val_docs": 0})
    got = _trainer_losses(cfg)
    ref_corpus = tokenize_corpus(corpus_files["docs"], corpus_files["tok"])
    bundle = build_data(DataConfig(source=str(prepared["both"]), val_docs=0), 320, 16)
    bundle.train = SequenceDataset(ref_corpus, 16, True)
    ref = _trainer_losses(tiny_config(str(tmp_path / "m"), data={"source": str(prepared["both"]), "max_docs": 0,
                                                                   "val_docs": 0}), bundle)
    assert len(got) == 5
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=0)
    # and without the background prefetch: the same losses
    off = _trainer_losses(tiny_config(str(tmp_path / "o"), data={"source": str(prepared["both"]), "max_docs": 0,
                                                                   "val_docs": 0, "prefetch": 0}))
    torch.testing.assert_close(torch.tensor(off), torch.tensor(got), rtol=0, atol=0)


def test_interrupted_prepare_resumes_without_redoing_shards(corpus_files, prepared, tmp_path):
    raw, out = corpus_files["root"], tmp_path / "resumed"
    srcs = [str(raw / "a.jsonl"), str(raw / "b")]
    m = prepare(srcs, corpus_files["tokfile"], out, shard_tokens=200000, progress=False, _stop_after_shards=2)
    assert not m["complete"] and len(m["shards"]) == 2
    (out / ".shard-00002.bin.tmp").write_bytes(b"half a shard")  # what a kill mid-shard leaves
    with pytest.raises(ConfigError, match="has not finished"):
        open_shards(out)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-0000[01].*")}
    prepare(srcs, corpus_files["tokfile"], out, shard_tokens=200000, progress=False)
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-0000[01].*")}
    assert before == after and len(before) == 4  # finished shards were not rewritten
    assert not list(out.glob(".*.tmp"))
    assert _shard_bytes(out) == _shard_bytes(prepared["both"])
    assert read_manifest(out)["tokens"] == read_manifest(prepared["both"])["tokens"]


def test_default_corpus_goes_through_the_prepared_cache(tmp_path):
    cfg = DataConfig(max_docs=30, cache_dir=str(tmp_path))
    bundle = build_data(cfg, 320, 16)
    folders = list(tmp_path.glob("prepared-*"))
    assert len(folders) == 1 and read_manifest(folders[0])["complete"]
    assert all(isinstance(s.tokens, np.memmap) for s in bundle.train.corpus.shards)
    again = build_data(cfg, 320, 16)
    assert list(tmp_path.glob("prepared-*")) == folders
    torch.testing.assert_close(again.train.batch(range(8)), bundle.train.batch(range(8)), rtol=0, atol=0)


# --------------------------------------------------------------------------- mixtures


@pytest.mark.parametrize("weights", [[3, 1], [0.5, 0.3, 0.2], [1, 1, 5]])
def test_mixture_proportions_exact_and_layout_free(weights):
    sizes = [37, 11, 90][: len(weights)]
    s = MixtureSampler(sizes, weights, global_batch=8, seed=4)
    w = np.asarray(weights, dtype=float) / sum(weights)
    bases = np.concatenate([[0], np.cumsum(sizes)])
    drawn = np.zeros(len(sizes), dtype=np.int64)
    per_source: list[list[int]] = [[] for _ in sizes]
    for step in range(1, 60):
        batch = s.next()
        src = np.searchsorted(bases, batch.numpy(), side="right") - 1
        for i, g in zip(src, batch.tolist()):
            per_source[i].append(g - bases[i])
        drawn += np.bincount(src, minlength=len(sizes))
        exact = w * step * 8
        assert np.all(drawn >= np.floor(exact - 1e-9)) and np.all(drawn <= np.ceil(exact + 1e-9)), (step, drawn, exact)
        for dp in (2, 4):  # the ranks' slices put back together are the global batch
            torch.testing.assert_close(torch.cat([rank_slice(batch, r, dp) for r in range(dp)]), batch)
    assert list(drawn) == list(s.source_counts().values())
    for i, n in enumerate(sizes):  # each source walks whole epochs: every sequence once per epoch
        full = (len(per_source[i]) // n) * n
        counts = np.bincount(per_source[i][:full], minlength=n)
        assert np.all(counts == full // n)


def test_mixture_resumes_exactly_from_small_state():
    a = MixtureSampler([37, 11], [3, 1], 8, seed=1)
    straight = [a.next() for _ in range(30)]
    b = MixtureSampler([37, 11], [3, 1], 8, seed=1)
    for _ in range(13):
        b.next()
    state = b.state_dict()
    assert len(state) <= 4 + 4 * 2 and all(isinstance(v, int) for v in state.values())  # O(sources)
    c = MixtureSampler([37, 11], [3, 1], 8, seed=1)
    c.load_state_dict(state)
    for want in straight[13:]:
        torch.testing.assert_close(c.next(), want)
    assert peek(c, 0) == []
    with pytest.raises(ConfigError, match="data.mix_sources"):
        MixtureSampler([37, 12], [3, 1], 8, seed=1).load_state_dict(state)


def _mix_cfg(run_dir, prepared, **train):
    return tiny_config(run_dir, data={"mix_sources": [str(prepared["a"]), str(prepared["b"])],
                                      "mix_weights": [3, 1], "max_docs": 0, "val_docs": 0},
                       train={"checkpoint_every": 0, **train})


def test_mixture_training_resumes_exactly(prepared, tmp_path):
    import shutil

    straight = _trainer_losses(_mix_cfg(str(tmp_path / "s"), prepared, steps=6, checkpoint_every=3))
    shutil.rmtree(tmp_path / "s" / "checkpoints" / "step-6")  # as if stopped after step 3's checkpoint
    records = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    rest = _trainer_losses(_mix_cfg(str(tmp_path / "s"), prepared, steps=6, resume="auto"))
    assert len(rest) == 3
    torch.testing.assert_close(torch.tensor(rest), torch.tensor(straight[3:]), rtol=1e-12, atol=1e-12)
    tokens = records[-1]["data_tokens"]
    assert list(tokens.values()) == [6 * 6 * 16, 2 * 6 * 16]  # 3:1 of 6 steps x 8 sequences x 16 tokens


def _local_batches(cfg_dict, steps):
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    out = [tr.local_batch()["inputs"] for _ in range(steps)]
    tr.prefetcher.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_same_batches_and_losses_for_any_dp(prepared, tmp_path, world):
    cfg = _mix_cfg(str(tmp_path / "one"), prepared)
    ref = _local_batches(cfg, 4)
    got = run_on(world, _local_batches, _mix_cfg(str(tmp_path / "dp"), prepared), 4)
    for step in range(4):
        torch.testing.assert_close(torch.cat([g[step] for g in got]), ref[step], rtol=0, atol=0)
    if world == 2:  # and training on them: one process vs 2 ranks, float64
        one = train_collect(_mix_cfg(str(tmp_path / "t1"), prepared))
        two = run_on(2, train_collect, _mix_cfg(str(tmp_path / "t2"), prepared,))[0]
        assert_runs_match(one, two)


# --------------------------------------------------------------------------- bad input (one line each)


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_malformed_records_name_line_and_field(corpus_files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: not valid JSON") as err:
        prepare([str(bad)], corpus_files["tokfile"], tmp_path / "o1", progress=False)
    _one_line(err)
    bad.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: no field 'text'.*--text-field"):
        prepare([str(bad)], corpus_files["tokfile"], tmp_path / "o2", progress=False)
    bad.write_text('{"text": 5}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: field 'text' is a int"):
        prepare([str(bad)], corpus_files["tokfile"], tmp_path / "o3", progress=False)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ConfigError, match=r"p.parquet: no column 'text'"):
        prepare([str(tmp_path / "p.parquet")], corpus_files["tokfile"], tmp_path / "o4", progress=False)
    with pytest.raises(ConfigError, match="--tokenizer"):
        prepare([str(bad)], str(tmp_path), tmp_path / "o5", progress=False)  # a directory without tokenizer.json
    assert main(["prepare", str(tmp_path / "nothing"), "--tokenizer", corpus_files["tokfile"],
                 "--out", str(tmp_path / "o6")]) == 2


def test_bad_prepared_datasets_are_one_line(corpus_files, prepared, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(prepared["both"], d)
    with pytest.raises(ConfigError, match="model.vocab_size >= 320") as err:  # vocabulary larger than the model's
        prepared_corpus(d, None, 256)
    _one_line(err)
    other = get_tokenizer("", ["completely different text " * 50, "for another tokenizer"], 300, str(tmp_path))
    with pytest.raises(ConfigError, match="data.tokenizer is not the tokenizer"):
        prepared_corpus(d, other, 320)
    shard = d / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    with pytest.raises(ConfigError, match=r"shard-00001.bin has \d+ bytes but the manifest says \d+") as err:
        prepared_corpus(d, None, 320)
    _one_line(err)
    shutil.copy(prepared["both"] / "shard-00001.bin", shard)
    idx = d / "shard-00000.idx"
    offs = np.fromfile(idx, dtype="<i8")
    offs[-1] -= 3
    offs.tofile(idx)  # corrupt offsets
    with pytest.raises(ConfigError, match="shard-00000.idx: document offsets do not match"):
        prepared_corpus(d, None, 320)
    # a second prepare into a folder holding another dataset changes nothing there
    before = _shard_bytes(prepared["a"])
    with pytest.raises(ConfigError, match="choose a new --out"):
        prepare([str(corpus_files["root"] / "b")], corpus_files["tokfile"], prepared["a"], progress=False)
    assert _shard_bytes(prepared["a"]) == before
    # config: mixture keys
    cfg = _mix_cfg(str(tmp_path / "r"), prepared)
    cfg["data"]["mix_weights"] = [1]
    with pytest.raises(ConfigError, match="one weight per source"):
        from meshfold.config import validate

        validate(from_dict(cfg))
    cfg["data"].update(mix_weights=[1, 1], mix_sources=[str(prepared["a"]), str(tmp_path)])
    with pytest.raises(ConfigError, match="is not a prepared dataset"):
        validate(from_dict(cfg))


def test_corpus_reads_across_shards(prepared):
    corpus, _ = prepared_corpus(prepared["both"], None, 320)
    whole = np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in corpus.shards])
    seam = int(corpus._tok_start[1])
    np.testing.assert_array_equal(corpus.read(seam - 5, seam + 5), whole[seam - 5: seam + 5])
    sub = corpus.subset(range(3, 40))
    np.testing.assert_array_equal(sub.read(0, 100), whole[corpus.offsets[3]: corpus.offsets[3] + 100])
    assert sub.n_docs == 37 and os.path.basename(str(prepared["both"])) == "both"


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    docs = ["w1 w69999 w65536 w5", "w65535 w65537"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    m = prepare([str(tmp_path / "d.jsonl")], tok, tmp_path / "out", progress=False)
    assert m["dtype"] == "uint32" and m["eos_id"] == 70_000
    corpus, _ = prepared_corpus(tmp_path / "out", None, 70_001)
    np.testing.assert_array_equal(corpus.read(0, corpus.n_tokens),
                                  [1, 69999, 65536, 5, 70000, 65535, 65537, 70000])
    with pytest.raises(ConfigError, match="model.vocab_size >= 70001"):
        prepared_corpus(tmp_path / "out", None, 65536)


def test_prepare_killed_mid_run_resumes_to_the_same_bytes(corpus_files, tmp_path):
    """A real SIGKILL while shards are being written, then the same command again."""
    import signal
    import subprocess
    import sys
    import time

    raw, out = corpus_files["root"], tmp_path / "killed"
    cmd = [sys.executable, "-m", "meshfold", "prepare", str(raw / "a.jsonl"), str(raw / "b"), "--tokenizer",
           corpus_files["tokfile"], "--out", str(out), "--shard-tokens", "50000", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(read_manifest(out)["shards"]) >= 2:
                break
        except (ConfigError, FileNotFoundError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    m = read_manifest(out)
    kept = {s["name"]: (out / f"{s['name']}.bin").stat().st_ino for s in m["shards"]}
    assert main(cmd[3:]) == 0
    ref = tmp_path / "ref"
    prepare([str(raw / "a.jsonl"), str(raw / "b")], corpus_files["tokfile"], ref, shard_tokens=50000, progress=False)
    assert _shard_bytes(out) == _shard_bytes(ref) and read_manifest(out)["complete"]
    assert all((out / f"{n}.bin").stat().st_ino == ino for n, ino in kept.items())  # not rewritten


def test_parquet_and_saved_hf_dataset_prepare_like_jsonl(corpus_files, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus_files["docs"][:12]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs))
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet", row_group_size=5)
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "hf"))
    outs = []
    for name in ("d.jsonl", "d.parquet", "hf"):
        out = tmp_path / f"out-{name}"
        m = prepare([str(tmp_path / name)], corpus_files["tokfile"], out, text_field="body", progress=False)
        assert m["docs"] == 12
        outs.append(_shard_bytes(out))
    assert outs[0] == outs[1] == outs[2]
