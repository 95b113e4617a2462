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

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from llmstack.errors import UserError

from .indexed import IndexedDataset


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
    """Blocks of `seq_len + 1` tokens from indexed datasets; batches are (micro, seq_len + 1) LongTensors."""

    def __init__(self, prefixes: str | Sequence[str | Path], seq_len: int, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(prefixes, str):
            prefixes = [prefixes]
        self.datasets = [IndexedDataset(p) for p in prefixes]
        self.seq_len = seq_len
        counts = [max(0, (d.num_tokens - 1) // seq_len) for d in self.datasets]
        self._offsets = np.cumsum([0] + counts)
        super().__init__(int(self._offsets[-1]), seed, shuffle)
        if self.num_blocks == 0:
            raise UserError(
                f"{', '.join(map(str, prefixes))} hold too few tokens for one sample of seq_len={seq_len} "
                f"(+1); use more data or a shorter data.seq_len"
            )

    def item(self, b: int) -> npt.NDArray[np.int64]:
        """Block b in storage order: `seq_len + 1` tokens as int64."""
        d = int(np.searchsorted(self._offsets, b, side="right")) - 1
        start = (b - int(self._offsets[d])) * self.seq_len
        return np.asarray(self.datasets[d].tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def collate(self, blocks: list[npt.NDArray[np.int64]]) -> torch.Tensor:
        return torch.from_numpy(np.stack(blocks))


class MixedBlocks(SampleSchedule):
    """A weighted mixture of named packed-shard sources: `[{name, prefixes, weight}, ...]`.

    Every block holds `seq_len` trained positions, so a source's share of the tokens is its share
    of the samples. With `weight_by="tokens"` (the default) a source's weight is its share of the
    samples; with `weight_by="documents"` its share of the documents, i.e. of the samples in
    proportion to weight x its mean document length in tokens. The global sample order is cut into
    chunks of `chunk` samples. Chunk c gives source s exactly A_s((c+1) * chunk) - A_s(c * chunk) samples, where
    A_s(n) is s's largest-remainder share of n samples, spread evenly over the chunk (the k-th of
    q samples at (k + 1/2) / q of it); each source reads its own blocks in its own seeded order,
    epoch after epoch. So sample i's source and block follow from i alone (resume on any number of
    ranks, as `PackedBlocks`), and every source is within one sample of its share of any prefix of
    the order and within two of its share of any window.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        weight_by: str = "tokens",
        chunk: int = 4096,
    ) -> None:
        from .mixture import check_weight_by, source_names, weights_of

        self.names = source_names(sources, "prefixes", (), "data.train")
        check_weight_by(weight_by)
        self.parts = [
            PackedBlocks(s["prefixes"], seq_len, seed=seed + 1_000_003 * (i + 1), shuffle=shuffle)
            for i, s in enumerate(sources)
        ]
        self.seq_len, self.weights = seq_len, weights_of(sources)
        targets = np.asarray(self.weights)
        if weight_by == "documents":
            tokens = [sum(d.num_tokens for d in p.datasets) for p in self.parts]
            documents = [max(1, sum(len(d) for d in p.datasets)) for p in self.parts]
            targets = targets * np.asarray(tokens) / np.asarray(documents)  # x mean document length
        self.targets = targets / targets.sum()  # each source's share of the samples
        self.chunk = max(chunk, int(np.ceil(4 / self.targets.min())))
        self._chunk_index, self._chunk_order = -1, (np.empty(0, np.int64), np.empty(0, np.int64))
        super().__init__(sum(len(p) for p in self.parts), seed, shuffle)

    def allotted(self, n: int) -> npt.NDArray[np.int64]:
        """A_s(n): each source's samples among the first n chunk-aligned ones (largest remainder,
        ties to the first source); they sum to n."""
        exact = self.targets * n
        counts = np.floor(exact).astype(np.int64)
        remainder = n - int(counts.sum())
        counts[np.argsort(-(exact - counts), kind="stable")[:remainder]] += 1
        return counts

    def chunk_order(self, c: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Chunk c's samples: (source, the source's own sample index) of each."""
        if c != self._chunk_index:
            start = self.allotted(c * self.chunk)
            quotas = self.allotted((c + 1) * self.chunk) - start
            sources = np.repeat(np.arange(len(quotas)), quotas)
            times = np.concatenate([(np.arange(q) + 0.5) / q for q in quotas if q])
            order = np.lexsort((sources, times))
            within = np.concatenate([np.arange(q) for q in quotas])
            self._chunk_index = c
            self._chunk_order = (sources[order], (start[sources] + within)[order])
        return self._chunk_order

    def sample(self, i: int) -> npt.NDArray[np.int64]:
        sources, indices = self.chunk_order(i // self.chunk)
        j = i % self.chunk
        return self.parts[int(sources[j])].sample(int(indices[j]))

    def collate(self, blocks: list[npt.NDArray[np.int64]]) -> torch.Tensor:
        return torch.from_numpy(np.stack(blocks))

    def source_samples(self, n: int) -> dict[str, int]:
        """How many of global samples [0, n) each source gave."""
        c, j = divmod(n, self.chunk)
        counts = self.allotted(c * self.chunk) + np.bincount(self.chunk_order(c)[0][:j], minlength=len(self.parts))
        return dict(zip(self.names, map(int, counts)))
