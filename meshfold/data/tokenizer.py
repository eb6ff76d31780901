"""Byte-level BPE tokenizers from Hugging Face ``tokenizers``: trained on the corpus and
cached by content hash, or loaded from a given ``tokenizer.json`` (or a model directory
holding one: ``load_tokenizer``, shared with the Hugging Face import)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshfold.errors import ConfigError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD]


def cache_root(cache_dir: str = "") -> Path:
    root = Path(cache_dir or os.environ.get("MESHFOLD_CACHE", "~/.cache/meshfold")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def corpus_digest(docs: list[str]) -> str:
    h = hashlib.sha256()
    for doc in docs:
        h.update(hashlib.sha256(doc.encode("utf-8", errors="replace")).digest())
    return h.hexdigest()[:16]


def train_bpe(docs: list[str], vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(
            f"model.vocab_size = {vocab_size} is too small for a byte-level tokenizer; use at least "
            f"{256 + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_tokenizer(path: str | Path, key: str = "--tokenizer") -> Tokenizer:
    """A Hugging Face ``tokenizers`` file: ``path`` is a tokenizer.json or a directory
    holding one (a model directory). Errors are one line naming ``key``."""
    file = Path(path).expanduser()
    if file.is_dir():
        if not (file / "tokenizer.json").is_file():
            raise ConfigError(f"{key} = {str(path)!r} is a directory without tokenizer.json; give a tokenizer.json "
                              f"or a model directory holding one")
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"{key} = {str(path)!r} does not exist; give a tokenizer.json or a directory holding one")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception for a bad file
        raise ConfigError(f"{key} = {str(path)!r}: not a Hugging Face tokenizer.json ({err})") from None


def tokenizer_sha256(tok: Tokenizer) -> str:
    """Identity of a tokenizer: sha256 of its canonical JSON (``Tokenizer.to_str``)."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def check_vocab(tok_vocab: int, vocab_size: int) -> None:
    if tok_vocab > vocab_size:
        raise ConfigError(
            f"the tokenizer has {tok_vocab} tokens but model.vocab_size = {vocab_size}; "
            f"set model.vocab_size >= {tok_vocab}"
        )


def get_tokenizer(path: str, docs: list[str], vocab_size: int, cache_dir: str = "") -> Tokenizer:
    """``path`` names a tokenizer.json (or a directory holding one), or is empty to train
    (once, then cached) on ``docs``."""
    if path:
        tok = load_tokenizer(path, "data.tokenizer")
    else:
        cached = cache_root(cache_dir) / f"bpe-{corpus_digest(docs)}-{vocab_size}.json"
        if cached.exists():
            tok = Tokenizer.from_file(str(cached))
        else:
            tok = train_bpe(docs, vocab_size)
            atomic_write_text(cached, tok.to_str())
    check_vocab(tok.get_vocab_size(), vocab_size)
    return tok


def special_id(tok: Tokenizer, token: str) -> int:
    idx = tok.token_to_id(token)
    if idx is None:
        # A foreign tokenizer without our specials: fall back to its own end-of-text marks.
        for alt in ("</s>", "<|end_of_text|>", "<eos>", "[SEP]"):
            idx = tok.token_to_id(alt)
            if idx is not None:
                return idx
        return 0
    return idx
