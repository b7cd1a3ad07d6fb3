"""Loaders over prepared shards: shuffled, rank-sharded, resumable training windows and
per-domain validation windows.

Shapes: B = micro-batch size (samples), S = ``seq_len`` (tokens). A sample is a window of S + 1
consecutive tokens of one shard; ``input_ids`` are its first S tokens and ``labels`` its last S
(the window shifted by one). Windows start every S tokens, so consecutive windows share one token
and every token of a shard except the first is a label exactly once per pass (Megatron-LM's
``GPTDataset`` sample index does the same). A shard of N tokens holds ``(N - 1) // S`` windows;
the ``N - 1 - S * windows`` tokens after the last window are the declared remainder.

Training order (epoch e, seed s): source i contributes ``round(weight_i * windows_i)`` windows per
epoch, taken in order from the concatenation of its own seeded permutations (so weight 1.0 = each
window once, 2.0 = twice, 0.5 = a different half each epoch); all contributions are then shuffled
together with a seeded permutation. The epoch is cut to a multiple of the global micro-batch
``dp_world_size * B``; data-parallel rank r reads positions ``[(t*W + r)*B, (t*W + r + 1)*B)`` at
step t, so ranks never share a position. Everything derives from (seed, epoch, step): a loader
restored with :meth:`TrainLoader.load_state_dict` yields exactly the batches the uninterrupted
one would have yielded.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from smelt_ds.data.distributed import rank_info
from smelt_ds.data.prepared import PreparedData, check_compatible
from smelt_ds.data.token_sources import PackedTokens
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.device import pin

__all__ = ["check_compatible", "windows_in", "TrainLoader", "ValidationLoader", "validation_loaders"]

_STATE_VERSION = 2  # 2: the epoch is cut to a multiple of the optimizer step's global batch (epoch_unit)


def windows_in(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens with stride ``seq_len`` in ``num_tokens`` tokens."""
    return max(0, (num_tokens - 1) // seq_len)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v <= 0:
            raise ConfigError(f"`{name}` ({v}) must be > 0: set a positive value")


class _Windows:
    """Window ids over a list of shards: id -> (shard, start token). Shapes in tokens."""

    def __init__(self, prepared: PreparedData, shards: list[dict], seq_len: int):
        self.prepared, self.shards, self.seq_len = prepared, shards, seq_len
        counts = np.array([windows_in(s["tokens"], seq_len) for s in shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])  # (num_shards + 1,)
        self.remainder_tokens = int(sum(s["tokens"] - (c * seq_len + 1) if c else s["tokens"]
                                        for s, c in zip(shards, counts, strict=True)))
        self._memmaps: dict[int, np.memmap | PackedTokens] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _tokens(self, k: int) -> np.memmap | PackedTokens:
        if k not in self._memmaps:
            self._memmaps[k] = self.prepared.tokens(self.shards[k])
        return self._memmaps[k]

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Windows ``ids`` (B,) -> tokens (B, S + 1) int64."""
        shard_idx = np.searchsorted(self.offsets, ids, side="right") - 1
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, (g, k) in enumerate(zip(ids, shard_idx, strict=True)):
            start = int(g - self.offsets[k]) * self.seq_len
            out[row] = self._tokens(int(k))[start:start + self.seq_len + 1]
        return out


def _batch(windows: np.ndarray, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
    """Host tensors of one micro-batch; ``input_ids`` and ``labels`` pinned when a CUDA device is
    present (:func:`smelt_ds.parallel.device.pin`: the copy to it is asynchronous); ``sample_ids``
    stay in ordinary host memory (they never leave the host)."""
    tokens = torch.from_numpy(windows)
    return {"input_ids": pin(tokens[:, :-1].contiguous()), "labels": pin(tokens[:, 1:].contiguous()),
            "sample_ids": torch.from_numpy(sample_ids)}


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(key)))


class TrainLoader:
    """Infinite iterator of training micro-batches for one data-parallel rank.

    Args:
        prepared: the prepared data (:func:`smelt_ds.data.prepare_from_config`).
        seq_len: S, tokens per sample (windows hold S + 1 tokens).
        micro_batch_size: B, samples per micro-batch on this rank.
        seed: shuffling seed (``data.seed``).
        dp_rank, dp_world_size: this rank and the number of data-parallel ranks (default: from
            torch.distributed or RANK / WORLD_SIZE).
        model_vocab_size, tokenizer_hash: when given, :func:`check_compatible` runs first.
        epoch_unit: samples each epoch is cut to a multiple of, the rest of the epoch dropped
            (default: ``dp_world_size * micro_batch_size``, the global micro-batch). Training
            passes the optimizer step's global batch, ``micro_batch_size x accumulation x
            dp_world_size``: that cut is the same at every layout with that global batch, and no
            optimizer step spans two epochs, so the same samples fall in the same optimizer steps
            and micro-batches whatever the data-parallel size (a resume at another layout,
            :meth:`load_state_dict`). Must be a multiple of the global micro-batch.

    Each ``next()`` returns ``{"input_ids": (B, S) int64, "labels": (B, S) int64,
    "sample_ids": (B,) int64}``; sample ids are global window ids, unique per position in an epoch.
    ``epoch`` and ``step`` (micro-batches done in the epoch) advance as batches are taken.

    Raises ConfigError when the train split holds no window of S + 1 tokens or fewer windows per
    epoch than one global micro-batch, or for bad sizes.
    """

    def __init__(self, prepared: PreparedData, seq_len: int, micro_batch_size: int, *, seed: int = 1234,
                 dp_rank: int | None = None, dp_world_size: int | None = None,
                 model_vocab_size: int | None = None, tokenizer_hash: str | None = None,
                 epoch_unit: int | None = None):
        info = rank_info()
        self.dp_rank = info.rank if dp_rank is None else dp_rank
        self.dp_world_size = info.world_size if dp_world_size is None else dp_world_size
        _check_positive(**{"train.seq_len": seq_len, "train.micro_batch_size": micro_batch_size,
                           "dp_world_size": self.dp_world_size})
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ConfigError(f"dp_rank ({self.dp_rank}) must be in [0, {self.dp_world_size}): pass the rank "
                              "within the data-parallel group")
        if model_vocab_size is not None:
            check_compatible(prepared, model_vocab_size, tokenizer_hash)
        self.prepared, self.seq_len, self.micro_batch_size, self.seed = prepared, seq_len, micro_batch_size, seed
        self.epoch_unit = self.global_batch if epoch_unit is None else epoch_unit
        if self.epoch_unit <= 0 or self.epoch_unit % self.global_batch:
            raise ConfigError(f"epoch_unit {self.epoch_unit} must be a positive multiple of the global micro-batch "
                              f"{self.global_batch} (dp_world_size x micro_batch_size)")
        self._init_windows()
        self.epoch, self.step = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def _init_windows(self) -> None:
        sources = self.prepared.meta["sources"]
        shards = [sh for s in sources for sh in self.prepared.shards("train", source=s["index"])]
        self.windows = _Windows(self.prepared, shards, self.seq_len)
        # (first window id, windows, weight) per source, in source order
        self._sources, first = [], 0
        for s in sources:
            n = sum(windows_in(sh["tokens"], self.seq_len) for sh in self.prepared.shards("train", source=s["index"]))
            if n == 0:
                raise ConfigError(f"source {s['index']} ({s['label']}) has {s['train_tokens']} train tokens and no "
                                  f"window of train.seq_len + 1 = {self.seq_len + 1} tokens in any shard "
                                  f"({self.prepared.root}): lower train.seq_len, add data, or drop the source")
            self._sources.append((first, n, s["weight"]))
            first += n
        if self.steps_per_epoch == 0:
            raise ConfigError(f"the train split has {self.windows_per_epoch} windows of {self.seq_len + 1} tokens per "
                              f"epoch, fewer than one global batch ({self.epoch_unit} samples: micro_batch_size "
                              f"{self.micro_batch_size} x accumulation x dp_world_size {self.dp_world_size}): lower "
                              "train.seq_len, train.micro_batch_size or the global batch, or add data")

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_windows(self) -> int:
        """Distinct training windows (samples) across all train shards."""
        return len(self.windows)

    @property
    def remainder_tokens(self) -> int:
        """Train tokens after the last window of each shard (never a label)."""
        return self.windows.remainder_tokens

    def _per_epoch(self, n: int, weight: float) -> int:
        return max(1, round(weight * n)) if n else 0

    @property
    def windows_per_epoch(self) -> int:
        """Samples drawn per epoch (sum of round(weight * windows) over sources)."""
        return sum(self._per_epoch(n, w) for _, n, w in self._sources)

    @property
    def global_batch(self) -> int:
        return self.dp_world_size * self.micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Micro-batches per rank per epoch (the epoch tail short of a whole :attr:`epoch_unit` is dropped)."""
        return self.windows_per_epoch // self.epoch_unit * self.epoch_unit // self.global_batch

    # -- order ---------------------------------------------------------------------------------
    def _source_stream(self, index: int, n: int, start: int, count: int) -> np.ndarray:
        """Positions [start, start + count) of source ``index``'s endless chain of permutations."""
        parts, pos = [], start
        while pos < start + count:
            k = pos // n
            perm = _rng(self.seed, 0, index, k).permutation(n)
            stop = min(n, start + count - k * n)
            parts.append(perm[pos - k * n:stop])
            pos = k * n + stop
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Window ids of an epoch in the order they are read, shape (windows_per_epoch,)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        parts = []
        for i, (first, n, w) in enumerate(self._sources):
            c = self._per_epoch(n, w)
            parts.append(first + self._source_stream(i, n, epoch * c, c))
        order = np.concatenate(parts)
        order = order[_rng(self.seed, 1, epoch).permutation(len(order))]
        self._order = (epoch, order)
        return order

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        start = (self.step * self.dp_world_size + self.dp_rank) * self.micro_batch_size
        ids = self.epoch_order(self.epoch)[start:start + self.micro_batch_size]
        self.step += 1
        return _batch(self.windows.gather(ids), ids.astype(np.int64))

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Position (epoch, samples consumed in it by all ranks) and the settings it depends on."""
        return {"version": _STATE_VERSION, "epoch": self.epoch, "epoch_unit": self.epoch_unit,
                "consumed_samples": self.step * self.global_batch, "seed": self.seed, "seq_len": self.seq_len,
                "num_windows": self.num_windows, "prepared_key": self.prepared.key,
                "train_digest": self.prepared.train_digest,
                "dp_world_size": self.dp_world_size, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``. Raises ConfigError if the seed, seq_len or data differ (the preparation
        key, or the train split's content: :attr:`PreparedData.train_digest`), or if the consumed
        samples are not a whole number of this loader's global micro-batches."""
        for name, mine in (("seed", self.seed), ("seq_len", self.seq_len), ("num_windows", self.num_windows),
                           ("prepared_key", self.prepared.key)):
            if state.get(name) != mine:
                raise ConfigError(f"loader state: {name} {state.get(name)!r} (checkpoint) != {mine!r} (this run): "
                                  f"resume with the same {name}, or start the data order afresh")
        recorded = state.get("train_digest")  # absent in checkpoints written before it was recorded
        if recorded is not None and recorded != self.prepared.train_digest:
            raise ConfigError(f"loader state: the train split of {str(self.prepared.root)!r} changed since the "
                              f"checkpoint (train data digest {recorded} (checkpoint) != {self.prepared.train_digest} "
                              "(now): it was prepared again under the same key, e.g. after a token file changed in "
                              "place), so the resumed run would read other documents at the same positions: restore "
                              "the files it was prepared from, or start a new run from this checkpoint's weights "
                              "(train.init_from)")
        # the run's epoch cut goes on (version 1 cut each epoch to the writer's global micro-batch)
        unit = int(state.get("epoch_unit") or int(state["dp_world_size"]) * int(state["micro_batch_size"]))
        if unit % self.global_batch:
            raise ConfigError(f"loader state: the run cuts its epochs to multiples of {unit} samples, which "
                              f"{self.dp_world_size} data-parallel rank(s) x micro_batch_size {self.micro_batch_size} "
                              f"= {self.global_batch} does not divide: the same samples would fall in other "
                              "micro-batches. Resume at a data-parallel size that divides "
                              f"{unit // self.micro_batch_size}" + ("" if state.get("epoch_unit") else
                                                                     " (an older checkpoint, which did not "
                                                                     "record its global batch: at the layout that "
                                                                     "wrote it)"))
        self.epoch_unit = unit
        consumed = int(state["consumed_samples"])
        if consumed % self.global_batch:
            raise ConfigError(f"loader state: {consumed} samples consumed is not a multiple of the global "
                              f"micro-batch {self.global_batch} (dp_world_size x micro_batch_size): resume with "
                              "sizes that divide it")
        self.epoch, self.step = int(state["epoch"]), consumed // self.global_batch


class ValidationLoader:
    """Validation micro-batches of one domain, in shard order, split over data-parallel ranks.

    Rank r reads windows r, r + W, r + 2W, ... of the domain's validation shards; every rank reads
    ``windows // W`` of them (the last ``windows % W`` are left out), so all ranks see the same
    number of micro-batches of the same sizes (the last may hold fewer than B samples).
    Iterating again starts from the beginning. Batches are as in :class:`TrainLoader`.
    ``split`` reads another split's shards in the same way (``train`` for an evaluation corpus).
    Raises ConfigError when the domain has no validation shard or fewer than W windows.
    """

    def __init__(self, prepared: PreparedData, domain: str, seq_len: int, micro_batch_size: int, *,
                 dp_rank: int | None = None, dp_world_size: int | None = None, max_batches: int | None = None,
                 split: str = "validation"):
        info = rank_info()
        self.dp_rank = info.rank if dp_rank is None else dp_rank
        self.dp_world_size = info.world_size if dp_world_size is None else dp_world_size
        _check_positive(**{"train.seq_len": seq_len, "micro_batch_size": micro_batch_size})
        shards = prepared.shards(split, domain=domain)
        self.domain, self.micro_batch_size, self.max_batches = domain, micro_batch_size, max_batches
        self.windows = _Windows(prepared, shards, seq_len)
        tokens = sum(s["tokens"] for s in shards)
        if len(self.windows) < self.dp_world_size:
            raise ConfigError(f"validation set of domain {domain!r} ({tokens} tokens, {len(shards)} shards) holds "
                              f"{len(self.windows)} windows of {seq_len + 1} tokens, fewer than the "
                              f"{self.dp_world_size} data-parallel ranks: raise data.validation_share, add data "
                              "or lower train.seq_len")
        per_rank = len(self.windows) // self.dp_world_size
        self.sample_ids = np.arange(per_rank, dtype=np.int64) * self.dp_world_size + self.dp_rank

    def __len__(self) -> int:
        n = -(-len(self.sample_ids) // self.micro_batch_size)
        return n if self.max_batches is None else min(n, self.max_batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for b in range(len(self)):
            ids = self.sample_ids[b * self.micro_batch_size:(b + 1) * self.micro_batch_size]
            yield _batch(self.windows.gather(ids), ids)


def validation_loaders(prepared: PreparedData, seq_len: int, micro_batch_size: int,
                       **kwargs) -> dict[str, ValidationLoader]:
    """A :class:`ValidationLoader` per domain that has validation shards, keyed by domain."""
    return {d: ValidationLoader(prepared, d, seq_len, micro_batch_size, **kwargs)
            for d in prepared.domains if prepared.shards("validation", domain=d)}
