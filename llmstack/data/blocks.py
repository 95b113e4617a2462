"""Fixed-length training samples cut from packed token shards, in a seeded order that resumes exactly.

The tokens of one or more indexed datasets (documents already end with the EOS token) are cut
into blocks of `seq_len + 1` tokens, consecutive blocks overlapping by one token, so that a block
gives `seq_len` inputs and their `seq_len` next-token targets. Each epoch visits every block
once in an order drawn from `seed + epoch`.

Samples are numbered globally. Micro-batch k on data-parallel rank r holds samples
`consumed + k * micro * dp_size + r * micro + [0, micro)`: ranks read disjoint slices, and a
run that resumes from its consumed-sample count (on any number of ranks) reads exactly the
samples an uninterrupted run would have read next, none skipped and none repeated.
"""

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from llmstack.errors import UserError

from .documents import block_starts, causal_batch
from .indexed import IndexedDataset
from .mixture import WeightSchedule, check_weight_by, source_names, weights_of


class SampleSchedule:
    """The seeded per-epoch order of `num_blocks` items and each rank's slice of it.

    Subclasses say what an item is (`item(j)`) and how items make a batch (`collate(items)`).
    """

    def __init__(self, num_blocks: int, seed: int = 0, shuffle: bool = True) -> None:
        self.num_blocks = num_blocks
        self.seed = seed
        self.shuffle = shuffle
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)  # no epoch's order drawn yet

    def __len__(self) -> int:
        return self.num_blocks

    def item(self, j: int) -> Any:
        """Item j in storage order."""
        raise NotImplementedError

    def collate(self, items: list[Any]) -> Any:
        """The batch made of `items`."""
        raise NotImplementedError

    def sample(self, i: int) -> Any:
        """Global sample i: item order[i mod N] of epoch i // N."""
        epoch, j = divmod(i, self.num_blocks)
        if not self.shuffle:
            return self.item(j)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_blocks)
        return self.item(int(self._order[j]))

    def micro_batches(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> Iterator[Any]:
        """Endless micro-batches for one data-parallel rank."""
        start = consumed_samples + dp_rank * micro_batch_size
        while True:
            yield self.collate([self.sample(start + i) for i in range(micro_batch_size)])
            start += micro_batch_size * dp_size

    def eval_batches(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> Iterator[Any]:
        """The first `num_samples` samples (fewer if the data is smaller), split across ranks."""
        mine = list(range(dp_rank, min(num_samples, self.num_blocks), dp_size))
        for k in range(0, len(mine), micro_batch_size):
            yield self.collate([self.sample(i) for i in mine[k : k + micro_batch_size]])


class PackedBlocks(SampleSchedule):
    """Blocks of `seq_len + 1` tokens from indexed datasets; batches are (micro, seq_len + 1) LongTensors.

    With `document_masking` an item is (tokens, document starts) and a batch is the model's keyword
    arguments with the documents' positions and numbers (`documents.causal_batch`), the starts
    read from the shards' document index."""

    def __init__(
        self,
        prefixes: str | Sequence[str | Path],
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        document_masking: bool = False,
    ) -> None:
        prefixes = as_list(prefixes)
        self.datasets = [IndexedDataset(p) for p in prefixes]
        self.seq_len = seq_len
        self.document_masking = document_masking
        self._document_offsets: dict[int, npt.NDArray[np.int64]] = {}
        counts = [max(0, (d.num_tokens - 1) // seq_len) for d in self.datasets]
        self._offsets = np.cumsum([0] + counts)
        super().__init__(int(self._offsets[-1]), seed, shuffle)
        if self.num_blocks == 0:
            raise UserError(
                f"{', '.join(map(str, prefixes))} hold too few tokens for one sample of seq_len={seq_len} "
                f"(+1); use more data or a shorter data.seq_len"
            )

    def item(self, b: int) -> Any:
        """Block b in storage order: `seq_len + 1` tokens as int64 (with document masking, and
        the document starts of its `seq_len` inputs)."""
        d = int(np.searchsorted(self._offsets, b, side="right")) - 1
        start = (b - int(self._offsets[d])) * self.seq_len
        tokens = np.asarray(self.datasets[d].tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if not self.document_masking:
            return tokens
        return tokens, block_starts(self.document_offsets(d), start, self.seq_len)

    def document_offsets(self, d: int) -> npt.NDArray[np.int64]:
        """The token offset of each document of dataset d (sorted)."""
        if d not in self._document_offsets:
            dataset = self.datasets[d]
            self._document_offsets[d] = np.asarray(dataset.pointers, dtype=np.int64) // dataset.dtype.itemsize
        return self._document_offsets[d]

    def collate(self, blocks: list[Any]) -> Any:
        return collate_blocks(blocks, self.document_masking)


class MixturePeriod:
    """The order of a packed mixture's samples from global sample `start` (at training step
    `step`, `samples_per_step` a step) on: source s's k-th sample comes at the sample t where its
    expected count offsets[s] + samples_per_step x (W_s(step + (t - start) / samples_per_step) -
    W_s(step)) reaches k + 1/2 (W_s: the integral of its share under `schedule`), ties to the
    first source. So every source is within one sample of its scheduled count at every point and
    within two in any window, and sample i's source and index follow from i alone. `offsets`
    (each source's samples before `start`) continue a run whose mixture changed at `start`.
    Samples are placed `chunk` samples of expected counts at a time (the order does not depend on it)."""

    def __init__(
        self,
        schedule: WeightSchedule,
        start: int = 0,
        step: float = 0.0,
        samples_per_step: int = 1,
        offsets: Sequence[int] | None = None,
        chunk: int = 1024,
    ) -> None:
        self.schedule, self.start, self.step, self.samples_per_step = schedule, start, float(step), samples_per_step
        size = len(schedule.names)
        self.offsets = np.zeros(size, np.int64) if offsets is None else np.asarray(offsets, np.int64)
        self.chunk = max(chunk, 2 * size)
        self._base = schedule.integral(self.step)
        self._chunk_index, self._chunk_order = -1, (np.empty(0, np.int64), np.empty(0, np.int64))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule.to_dict(),
            "start": self.start,
            "step": self.step,
            "samples_per_step": self.samples_per_step,
            "offsets": dict(zip(self.schedule.names, self.offsets.tolist())),
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], chunk: int = 1024) -> "MixturePeriod":
        schedule = WeightSchedule.from_dict(state["schedule"])
        offsets = [state["offsets"][name] for name in schedule.names]
        return cls(schedule, state["start"], state["step"], state["samples_per_step"], offsets, chunk)

    def step_of(self, t: float) -> float:
        """The training step at global sample t."""
        return self.step + (t - self.start) / self.samples_per_step

    def expected(self, t: float) -> npt.NDArray[np.float64]:
        """Each source's expected samples among the first t (>= start)."""
        return self.offsets + self.samples_per_step * (self.schedule.integral(self.step_of(t)) - self._base)

    def _counts_at(self, t: float) -> npt.NDArray[np.int64]:
        return np.floor(self.expected(t) + 0.5).astype(np.int64)

    def _boundary(self, c: int) -> int:
        """The first sample of chunk c."""
        return self.start + int((self._counts_at(self.start + c * self.chunk) - self.offsets).sum())

    def _locate(self, i: int) -> tuple[int, int]:
        """(chunk, place in it) of sample i."""
        if i < self.start:
            raise ValueError(f"sample {i} comes before this mixture's start at sample {self.start}")
        c = (i - self.start) // self.chunk
        while self._boundary(c) > i:
            c -= 1
        while self._boundary(c + 1) <= i:
            c += 1
        return c, i - self._boundary(c)

    def chunk_order(self, c: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Chunk c's samples: (source, the source's own sample index) of each."""
        if c != self._chunk_index:
            t = self.start + c * self.chunk
            low, high = self._counts_at(t), self._counts_at(t + self.chunk)
            sources = np.repeat(np.arange(len(low)), high - low)
            indices = np.concatenate([np.arange(lo, hi) for lo, hi in zip(low, high)])
            reached = np.concatenate(
                [
                    self.schedule.reaching(s, self._base[s] + (np.arange(lo, hi) + 0.5 - o) / self.samples_per_step)
                    for s, (lo, hi, o) in enumerate(zip(low, high, self.offsets))
                ]
            )
            order = np.lexsort((sources, reached))
            self._chunk_index, self._chunk_order = c, (sources[order], indices[order])
        return self._chunk_order

    def item(self, i: int) -> tuple[int, int]:
        """(source, the source's own sample index) of global sample i."""
        c, j = self._locate(i)
        sources, indices = self.chunk_order(c)
        return int(sources[j]), int(indices[j])

    def counts(self, n: int) -> npt.NDArray[np.int64]:
        """Each source's samples among the first n (n >= start; those before `start` included)."""
        c, j = self._locate(n)
        first = self._counts_at(self.start + c * self.chunk)
        return first + np.bincount(self.chunk_order(c)[0][:j], minlength=len(first))


class MixedBlocks(SampleSchedule):
    """A weighted mixture of named packed-shard sources: `[{name, prefixes, weight}, ...]`, whose
    weights may follow a `schedule` of training steps (`data.schedule`, see
    `mixture.WeightSchedule`) of `samples_per_step` samples each.

    Every block holds `seq_len` trained positions, so a source's share of the tokens is its share
    of the samples. With `weight_by="tokens"` (the default) a source's weight is its share of the
    samples; with `weight_by="documents"` its share of the documents, i.e. of the samples in
    proportion to weight x its mean document length in tokens. Sample i's source and the source's
    own sample index follow from i alone (`MixturePeriod`), so the mixture resumes on any number
    of ranks, as `PackedBlocks`; each source reads its own blocks in its own seeded order, epoch
    after epoch.

    `state_dict()` (JSON, saved with a checkpoint) holds the mixture in effect. Resumed with the
    same mixture, the order is the uninterrupted one; with other weights, another schedule, or
    sources added or removed (matched by name), the new mixture holds from the resume point on and
    every kept source goes on from its next sample (none repeated or skipped), a new one starts at
    its first. A source kept under its name must keep its prefixes.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        weight_by: str = "tokens",
        chunk: int = 1024,
        schedule: Mapping[str, Any] | None = None,
        samples_per_step: int = 1,
        document_masking: bool = False,
    ) -> None:
        self.names = source_names(sources, "prefixes", (), "data.train")
        check_weight_by(weight_by)
        self.document_masking = document_masking
        self.parts = [
            PackedBlocks(
                s["prefixes"],
                seq_len,
                seed=seed + 1_000_003 * (i + 1),
                shuffle=shuffle,
                document_masking=document_masking,
            )
            for i, s in enumerate(sources)
        ]
        self.seq_len, self.samples_per_step = seq_len, samples_per_step
        plan = WeightSchedule.from_config(schedule, self.names, weights_of(sources), "data.schedule")
        if weight_by == "documents":  # x mean document length: shares of the samples
            tokens = [sum(d.num_tokens for d in p.datasets) for p in self.parts]
            documents = [max(1, sum(len(d) for d in p.datasets)) for p in self.parts]
            plan = plan.scaled(np.asarray(tokens) / np.asarray(documents))
        self.schedule = plan  # each source's share of the samples, by step
        self.period = MixturePeriod(plan, samples_per_step=samples_per_step, chunk=chunk)
        self.prefixes = {n: [str(p) for p in as_list(s["prefixes"])] for n, s in zip(self.names, sources)}
        self.identity = {"sources": self.prefixes, "seq_len": seq_len, "seed": seed}
        self._saved: dict | None = None
        super().__init__(sum(len(p) for p in self.parts), seed, shuffle)

    def sample(self, i: int) -> Any:
        source, index = self.period.item(i)
        return self.parts[source].sample(index)

    def collate(self, blocks: list[Any]) -> Any:
        return collate_blocks(blocks, self.document_masking)

    def micro_batches(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> Iterator[Any]:
        if self._saved is not None:
            self.period = self._continued(self._saved, consumed_samples)
            self._saved = None
        return super().micro_batches(consumed_samples, micro_batch_size, dp_rank, dp_size)

    def _continued(self, saved: Mapping[str, Any], consumed: int) -> MixturePeriod:
        """The mixture from sample `consumed` on, continuing the one `saved` there."""
        moved = sorted(n for n, p in saved["sources"].items() if n in self.prefixes and self.prefixes[n] != p)
        if moved or {k: saved[k] for k in ("seq_len", "seed")} != {k: self.identity[k] for k in ("seq_len", "seed")}:
            raise UserError(
                "the packed mixture (data.train) differs from the checkpoint's in what its sources read "
                f"({', '.join(moved) or 'data.seq_len or data.seed'}): a resumed mixture may change weights, its "
                "schedule and add or remove sources, but a source keeps its prefixes under its name, and "
                "data.seq_len and data.seed stay as they were"
            )
        before = MixturePeriod.from_dict(saved["period"], self.period.chunk)
        same = before.schedule.to_dict() == self.schedule.to_dict() and before.samples_per_step == self.samples_per_step
        if same:
            return before
        counts = dict(zip(before.schedule.names, before.counts(consumed).tolist()))
        return MixturePeriod(
            self.schedule,
            consumed,
            before.step_of(consumed),
            self.samples_per_step,
            [counts.get(name, 0) for name in self.names],
            self.period.chunk,
        )

    def state_dict(self) -> dict[str, Any]:
        """The mixture in effect (JSON), which `load_state_dict` continues."""
        return {"period": self.period.to_dict(), **self.identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the mixture of `state` at the next `micro_batches` call."""
        self._saved = state

    def source_samples(self, n: int) -> dict[str, int]:
        """How many of global samples [0, n) each source gave."""
        return dict(zip(self.names, map(int, self.period.counts(n))))

    def expected_samples(self, n: int) -> dict[str, float]:
        """Each source's scheduled samples among the first n (its scheduled share at n = 0)."""
        expected = self.period.expected(n) if n else self.schedule.at(self.period.step_of(n))
        return dict(zip(self.names, map(float, expected)))


def collate_blocks(blocks: list[Any], document_masking: bool) -> torch.Tensor | dict[str, torch.Tensor]:
    """A (micro, seq_len + 1) LongTensor of token blocks, or with document masking the model's
    keyword arguments of (tokens, starts) items."""
    if not document_masking:
        return torch.from_numpy(np.stack(blocks))
    tokens, starts = zip(*blocks)
    return causal_batch(np.stack(tokens), np.stack(starts))


def as_list(prefixes: str | Sequence[str | Path]) -> list[str | Path]:
    return [prefixes] if isinstance(prefixes, str) else list(prefixes)
