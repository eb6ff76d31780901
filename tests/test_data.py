"""Data sources, tokenizer cache, packing with document boundaries, and a sampler whose
order does not depend on the layout and resumes exactly."""

import json

import numpy as np
import pytest
import torch

from meshfold.config import ConfigError, DataConfig
from meshfold.data.dataset import (IGNORE_INDEX, GlobalBatchSampler, SequenceDataset, TokenizedCorpus,
                                   build_data, rank_slice, tokenize_corpus)
from meshfold.data.sources import default_corpus_files, load_documents
from meshfold.data.tokenizer import EOS, get_tokenizer

DOCS = ["alpha beta gamma " * 5, "delta epsilon " * 7, "zeta eta theta iota " * 3]


def test_default_corpus_exists_everywhere():
    files = default_corpus_files()
    assert len(files) > 50
    docs = load_documents(DataConfig(max_docs=5))
    assert len(docs) == 5 and all(d.strip() for d in docs)


def test_text_folder_jsonl_parquet_and_hf_dataset(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"{i}.txt").write_text(doc)
    assert load_documents(DataConfig(source=str(folder))) == DOCS
    assert load_documents(DataConfig(source=str(folder / "1.txt"))) == [DOCS[1]]

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)))
    assert load_documents(DataConfig(source=str(jsonl))) == DOCS
    with pytest.raises(ConfigError, match="data.text_field"):
        load_documents(DataConfig(source=str(jsonl), text_field="body"))

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet")
    assert load_documents(DataConfig(source=str(tmp_path / "d.parquet"))) == DOCS

    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "hf"))
    assert load_documents(DataConfig(source=str(tmp_path / "hf"))) == DOCS


def test_missing_source_is_one_line():
    with pytest.raises(ConfigError, match="data.source"):
        load_documents(DataConfig(source="/nonexistent/corpus"))


def test_tokenizer_is_trained_once_and_cached(tmp_path):
    docs = load_documents(DataConfig(max_docs=10))
    tok = get_tokenizer("", docs, 300, str(tmp_path))
    cached = list(tmp_path.glob("bpe-*.json"))
    assert len(cached) == 1 and tok.get_vocab_size() <= 300
    again = get_tokenizer("", docs, 300, str(tmp_path))
    assert again.encode("def f(x): return x").ids == tok.encode("def f(x): return x").ids
    assert tok.decode(tok.encode("def f(x):\n    return x").ids) == "def f(x):\n    return x"
    with pytest.raises(ConfigError, match="model.vocab_size"):
        get_tokenizer(str(cached[0]), docs, 200, str(tmp_path))


def _corpus(lengths):
    pieces = [np.arange(1, n + 1, dtype=np.int32) + 100 * d for d, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenizedCorpus(np.concatenate(pieces), offsets.astype(np.int64), eos_id=0, pad_id=1)


def test_packing_keeps_document_boundaries():
    corpus = _corpus([5, 9, 3, 7])
    ds = SequenceDataset(corpus, seq_len=4, pack=True)
    assert len(ds) == (24 - 1) // 4
    batch = ds.batch(range(len(ds)))
    # Windows overlap by one token: labels are the next inputs, nothing is lost.
    flat_inputs = batch["inputs"].flatten()
    assert torch.equal(flat_inputs, torch.from_numpy(corpus.tokens[: len(flat_inputs)]).long())
    assert torch.equal(batch["labels"][:, :-1], batch["inputs"][:, 1:])
    # doc_ids change exactly where a document ends.
    docs = batch["doc_ids"].flatten().numpy()
    assert list(np.flatnonzero(np.diff(docs)) + 1) == [5, 14, 17]


def test_unpacked_sequences_pad_and_ignore():
    ds = SequenceDataset(_corpus([5, 9, 3]), seq_len=6, pack=False)
    b = ds.batch([0])
    assert b["inputs"].tolist()[0][:5] == [1, 2, 3, 4, 5]
    assert (b["labels"][0, 4:] == IGNORE_INDEX).all() and (b["labels"][0, :4] != IGNORE_INDEX).all()


def test_global_batches_do_not_depend_on_dp_degree():
    sampler = GlobalBatchSampler(n=50, global_batch=8, seed=3)
    batches = [sampler.next() for _ in range(12)]  # crosses an epoch boundary (50 // 8 = 6)
    for dp in (1, 2, 4, 8):
        seen = [torch.cat([rank_slice(b, r, dp) for r in range(dp)]) for b in batches]
        assert all(torch.equal(a, b) for a, b in zip(seen, batches))
    # Within an epoch no sequence repeats.
    first_epoch = torch.cat(batches[:6])
    assert len(set(first_epoch.tolist())) == 48


def test_sampler_resumes_exactly():
    a = GlobalBatchSampler(n=50, global_batch=8, seed=3)
    straight = [a.next() for _ in range(10)]
    b = GlobalBatchSampler(n=50, global_batch=8, seed=3)
    first = [b.next() for _ in range(4)]
    c = GlobalBatchSampler(n=50, global_batch=8, seed=3)
    c.load_state_dict(b.state_dict())
    resumed = first + [c.next() for _ in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(straight, resumed))
    with pytest.raises(ConfigError, match="data.source"):
        GlobalBatchSampler(n=49, global_batch=8, seed=3).load_state_dict(b.state_dict())


def test_build_data_end_to_end(tmp_path):
    bundle = build_data(DataConfig(max_docs=30, cache_dir=str(tmp_path)), vocab_size=320, seq_len=16)
    assert len(bundle.train) > 100
    assert bundle.tokenizer.token_to_id(EOS) is not None
    corpus_again = tokenize_corpus(load_documents(DataConfig(max_docs=30)), bundle.tokenizer, str(tmp_path))
    assert corpus_again.n_docs == 30
