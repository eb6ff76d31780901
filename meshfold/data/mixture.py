"""Weighted mixtures of datasets: every global batch draws from its sources in the given
proportions, deterministically, the same for any layout, resumable from O(sources) state.

Which source sample t comes from follows the largest-deficit rule: the source whose drawn
count lags its share ``w_i * (t + 1)`` the most (ties: the first). After any T samples
every source has floor or ceil of its exact share (a test checks this), whatever T and
however the steps are cut. Inside a source, samples walk a seeded permutation epoch by
epoch (each source's epochs independent of the others'). The state is, per source, a
count, an epoch and a cursor: resuming never replays what was consumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from meshfold.errors import ConfigError


class MixtureSampler:
    def __init__(self, sizes: list[int], weights: list[float], global_batch: int, seed: int,
                 names: list[str] | None = None):
        if not sizes:
            raise ConfigError("data.mix_sources is empty; list at least one prepared dataset")
        if any(not (math.isfinite(w) and w > 0) for w in weights):
            raise ConfigError(f"data.mix_weights = {weights}: every weight must be a positive number")
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.sizes, self.global_batch, self.seed = [int(n) for n in sizes], global_batch, seed
        self.names = names or [str(i) for i in range(len(sizes))]
        self.bases = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.n = int(self.bases[-1])
        self.t = 0
        self.counts = [0] * len(sizes)
        self.epochs = [0] * len(sizes)
        self.cursors = [0] * len(sizes)
        self._perms: dict[int, tuple[int, torch.Tensor]] = {}  # source -> (epoch, permutation)

    def _perm(self, i: int) -> torch.Tensor:
        cached = self._perms.get(i)
        if cached is None or cached[0] != self.epochs[i]:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epochs[i]) * 1_009 + i)
            cached = self._perms[i] = (self.epochs[i], torch.randperm(self.sizes[i], generator=gen))
        return cached[1]

    def _source(self) -> int:
        want = self.t + 1
        return max(range(len(self.sizes)), key=lambda i: (self.weights[i] * want - self.counts[i], -i))

    def next(self) -> torch.Tensor:
        out = torch.empty(self.global_batch, dtype=torch.int64)
        for k in range(self.global_batch):
            i = self._source()
            if self.cursors[i] == self.sizes[i]:
                self.epochs[i], self.cursors[i] = self.epochs[i] + 1, 0
            out[k] = int(self.bases[i]) + int(self._perm(i)[self.cursors[i]])
            self.cursors[i] += 1
            self.counts[i] += 1
            self.t += 1
        return out

    def source_counts(self) -> dict[str, int]:
        """Sequences drawn from each source so far (the whole run, all ranks together)."""
        return dict(zip(self.names, self.counts))

    def state_dict(self) -> dict:
        sd = {"t": self.t, "global_batch": self.global_batch, "seed": self.seed, "sources": len(self.sizes)}
        for i in range(len(self.sizes)):
            sd.update({f"n.{i}": self.sizes[i], f"count.{i}": self.counts[i], f"epoch.{i}": self.epochs[i],
                       f"cursor.{i}": self.cursors[i]})
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if int(sd.get("sources", -1)) != len(self.sizes) or any(
                int(sd[f"n.{i}"]) != n for i, n in enumerate(self.sizes)):
            raise ConfigError("the checkpoint's data mixture has other sources (or sizes) than data.mix_sources; "
                              "resume with the same data.mix_sources, model.seq_len and tokenizer")
        self.t = int(sd["t"])
        for i in range(len(self.sizes)):
            self.counts[i], self.epochs[i], self.cursors[i] = (int(sd[f"count.{i}"]), int(sd[f"epoch.{i}"]),
                                                               int(sd[f"cursor.{i}"]))


class MixtureDataset:
    """Several datasets seen as one index space (source i's sequences at ``bases[i]:``)."""

    def __init__(self, parts: list, weights: list[float], collate: Callable):
        self.parts, self.weights, self.collate = parts, weights, collate
        self.bases = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.seq_len = parts[0].seq_len

    def __len__(self) -> int:
        return int(self.bases[-1])

    def get(self, idx: int):
        i = int(np.searchsorted(self.bases, idx, side="right")) - 1
        return self.parts[i].get(idx - int(self.bases[i]))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        return self.collate([self.get(int(i)) for i in indices])

    def make_sampler(self, global_batch: int, seed: int) -> MixtureSampler:
        return MixtureSampler([len(p) for p in self.parts], self.weights, global_batch, seed,
                              [p.name for p in self.parts])


class MixtureTokens:
    """The data-mixture feature (``train/feature.py``): ``data_tokens`` in metrics.jsonl,
    the tokens drawn from each source so far, while the run draws from the mixture's own
    sampler (a feature registered before it may replace the sampler: then nothing)."""

    name = None

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.sampler: MixtureSampler | None = None

    def wrap_sampler(self, sampler):
        self.sampler = sampler if isinstance(sampler, MixtureSampler) else None
        return sampler

    def after_batch(self) -> dict:
        if self.sampler is None:
            return {}
        return {"data_tokens": {k: v * self.seq_len for k, v in self.sampler.source_counts().items()}}


def build_mixture_tokens(cfg, parts) -> MixtureTokens | None:
    """The feature of a run that trains on a mixture (registered in ``train/registry.py``)."""
    return MixtureTokens(cfg.model.seq_len) if isinstance(parts.data.train, MixtureDataset) else None
