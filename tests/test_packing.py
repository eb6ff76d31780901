"""Packing keeps documents whole, and packed per-document attention computes exactly what
training on each document alone computes (float64)."""

import json
import math

import numpy as np
import pytest
import torch

from meshfold.data.dataset import TokenizedCorpus
from meshfold.data.packing import IGNORE_INDEX, DocumentPieces, PackingError, pack, packed_row, packed_rows


def corpus_of(lengths, seed=0, vocab=50):
    """A TokenizedCorpus of documents with the given token counts (EOS = 1, pad = 0)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, vocab, size=L - 1), 1).astype(np.int32) for L in lengths]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return TokenizedCorpus(np.concatenate(docs), offsets, eos_id=1, pad_id=0)


@pytest.mark.parametrize("method", ["bfd", "ffd"])
def test_pack_keeps_every_item_once_within_capacity(method):
    rng = np.random.default_rng(1)
    for trial in range(20):
        lengths = rng.integers(1, 64, size=rng.integers(1, 80)).tolist()
        bins = pack(lengths, 64, method)
        flat = sorted(i for b in bins for i in b)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
        # FFD/BFD guarantee: at most 11/9 OPT + 6/9 bins, and OPT >= ceil(sum / capacity).
        lower = math.ceil(sum(lengths) / 64)
        assert len(bins) <= 11 / 9 * max(lower, 1) + 6 / 9 + 1e-9 or len(bins) <= lower + 1
        assert pack(lengths, 64, method) == bins  # deterministic


def test_pack_best_fit_picks_fullest_bin():
    # 8 -> bin 0 (room 2), 6 -> bin 1 (room 4), 3 -> bin 1 (room 1). The last item of 1 fits
    # both: first fit takes the oldest bin (0), best fit the fullest (1).
    assert pack([8, 6, 3, 1], 10, "ffd") == [[0, 3], [1, 2]]
    assert pack([8, 6, 3, 1], 10, "bfd") == [[0], [1, 2, 3]]
    # Items are taken longest first whatever their input order.
    assert pack([1, 3, 8, 6], 10, "bfd") == [[2], [3, 1, 0]]


def test_pack_rejects_oversized_items():
    with pytest.raises(PackingError, match="does not fit"):
        pack([3, 11], 10)
    with pytest.raises(PackingError, match="choose one of"):
        pack([3], 10, "worst")


def test_pieces_cover_every_prediction_once():
    lengths = [2, 5, 17, 18, 40, 1]
    corpus = corpus_of(lengths)
    pieces = DocumentPieces(corpus, max_len=16)
    assert all(0 < x <= 16 for x in pieces.lengths)
    for d, L in enumerate(lengths):
        ids = pieces.doc_pieces[d]
        assert sum(pieces.lengths[p] for p in ids) == max(L - 1, 0)
        # Consecutive pieces: their inputs tile the document's first L-1 tokens, labels the last L-1.
        inputs = np.concatenate([pieces.tokens(p)[:-1] for p in ids]) if ids else np.zeros(0)
        labels = np.concatenate([pieces.tokens(p)[1:] for p in ids]) if ids else np.zeros(0)
        np.testing.assert_array_equal(inputs, corpus.doc(d)[:-1])
        np.testing.assert_array_equal(labels, corpus.doc(d)[1:])
    assert pieces.doc_pieces[5] == []  # a one-token document has nothing to predict


def test_packed_row_layout():
    pieces = DocumentPieces(corpus_of([4, 3, 6]), max_len=16)
    row = packed_row(pieces, [2, 0], pad_to=12)
    assert row["inputs"].shape == (1, 12)
    assert row["positions"][0].tolist()[:8] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert row["doc_ids"][0].tolist() == [2] * 5 + [0] * 3 + [-1] * 4
    assert (row["labels"][0, 8:] == IGNORE_INDEX).all()
    empty = packed_row(pieces, [])
    assert empty["inputs"].shape == (1, 1) and empty["labels"].item() == IGNORE_INDEX
    rows = packed_rows(pieces, [0, 1, 2], seq_len=8, rows=3)
    assert rows["inputs"].shape == (3, 8)
    assert int((rows["labels"] != IGNORE_INDEX).sum()) == 3 + 2 + 5


# --------------------------------------------------------------------------- same computation


def _model(attention: str):
    from meshfold.config import ModelConfig
    from meshfold.models.llama import Transformer, init_weights
    from meshfold.models.varlen_attention import use_varlen_attention

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=16)
    model = Transformer(cfg)
    init_weights(model, cfg, seed=3)
    model.double()
    if attention == "varlen":
        assert use_varlen_attention(model) == 2
    return model


def _loss_and_grads(model, batches):
    from meshfold.train.trainer import cross_entropy_sum

    model.zero_grad()
    total = 0.0
    for b in batches:
        doc_ids = b.get("doc_ids")
        loss = cross_entropy_sum(model(b["inputs"], positions=b.get("positions"), doc_ids=doc_ids), b["labels"])
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_equals_per_document():
    """Packed (flat varlen row, flat masked row, BFD rows of seq_len) == each document alone."""
    pieces = DocumentPieces(corpus_of([17, 3, 9, 12, 2, 5, 16, 8], seed=4), max_len=16)
    ids = list(range(len(pieces)))
    alone = [{"inputs": torch.from_numpy(pieces.tokens(p)[:-1].astype(np.int64)).unsqueeze(0),
              "labels": torch.from_numpy(pieces.tokens(p)[1:].astype(np.int64)).unsqueeze(0)} for p in ids]
    ref_loss, ref_grads = _loss_and_grads(_model("plain"), alone)
    row = packed_row(pieces, ids)
    variants = {
        "varlen-flat": (_model("varlen"), [row]),
        "masked-flat": (_model("plain"), [row]),
        "varlen-bfd-rows": (_model("varlen"), [packed_rows(pieces, ids, seq_len=16)]),
        "masked-bfd-rows": (_model("plain"), [packed_rows(pieces, ids, seq_len=16, method="ffd")]),
    }
    for name, (model, batches) in variants.items():
        loss, grads = _loss_and_grads(model, batches)
        assert loss == pytest.approx(ref_loss, rel=1e-12), name
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{name} {n}: {m}")


# --------------------------------------------------------------------------- trainer


def write_short_docs(path, n=48, seed=0):
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta eps zeta eta theta iota kappa lambda mu".split()
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 9)))}) + "\n")
    return str(path)


def test_packed_training_matches_per_document_training(tmp_path):
    """Trainer with data.balance (documents packed, per-document attention) gives the same
    losses and weights over 5 steps as training on each document alone, padded, one
    document per row (data.pack = false), on the same documents per step."""
    from meshfold.config import from_dict
    from meshfold.data.packing import DocumentPieces
    from meshfold.testing import tiny_config
    from meshfold.parallel.balanced_loader import BalancedBatches
    from meshfold.train.trainer import Trainer

    source = write_short_docs(tmp_path / "docs.jsonl")
    common = dict(model={"seq_len": 32}, data={"source": source, "max_docs": 0, "val_docs": 0})
    packed_cfg = tiny_config(str(tmp_path / "packed"), **common)
    packed_cfg["data"].update(balance="greedy", cost_a=0.01, cost_b=1.0)
    packed_cfg["train"].update(global_batch=2)  # 64-token budget: several documents per step
    packed = Trainer(from_dict(packed_cfg))
    assert packed.features.of_type(BalancedBatches).pieces.lengths.max() < 32  # every document is one piece
    got = packed.fit()

    plain_cfg = tiny_config(str(tmp_path / "plain"), **common)
    plain_cfg["data"].update(pack=False)
    plain = Trainer(from_dict(plain_cfg))
    pieces = DocumentPieces(plain.data.train.corpus, 32)
    replay = type(packed.features.of_type(BalancedBatches).sampler)(pieces.lengths, pieces.doc_pieces, 64, seed=0)
    doc_rows = {int(d): i for i, d in enumerate(plain.data.train.docs)}

    def per_document_batch():
        docs = [int(pieces.doc[p]) for p in replay.next()]
        return plain.data.train.batch([doc_rows[d] for d in docs])

    plain.local_batch = per_document_batch
    want = plain.fit()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-10, atol=1e-12)
    for (n, p), (_, q) in zip(packed.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=lambda m, n=n: f"{n}: {m}")
