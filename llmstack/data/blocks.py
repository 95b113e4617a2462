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

import numpy as np
import torch

from llmstack.errors import UserError

from .indexed import IndexedDataset


class PackedBlocks:
    def __init__(self, prefixes, seq_len, seed=0, shuffle=True):
        if isinstance(prefixes, str):
            prefixes = [prefixes]
        self.datasets = [IndexedDataset(p) for p in prefixes]
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        counts = [max(0, (d.num_tokens - 1) // seq_len) for d in self.datasets]
        self._offsets = np.cumsum([0] + counts)
        self.num_blocks = int(self._offsets[-1])
        if self.num_blocks == 0:
            raise UserError(
                f"{', '.join(map(str, prefixes))} hold too few tokens for one sample of seq_len={seq_len} "
                f"(+1); use more data or a shorter data.seq_len"
            )
        self._epoch, self._order = None, None

    def __len__(self):
        return self.num_blocks

    def block(self, b):
        """Block b in storage order: `seq_len + 1` tokens as int64."""
        d = int(np.searchsorted(self._offsets, b, side="right")) - 1
        start = (b - int(self._offsets[d])) * self.seq_len
        return np.asarray(self.datasets[d].tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def sample(self, i):
        """Global sample i: block order[i mod N] of epoch i // N."""
        epoch, j = divmod(i, self.num_blocks)
        if not self.shuffle:
            return self.block(j)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_blocks)
        return self.block(int(self._order[j]))

    def micro_batches(self, consumed_samples, micro_batch_size, dp_rank, dp_size):
        """Endless (micro_batch_size, seq_len + 1) LongTensors for one data-parallel rank."""
        start = consumed_samples + dp_rank * micro_batch_size
        while True:
            yield torch.from_numpy(np.stack([self.sample(start + i) for i in range(micro_batch_size)]))
            start += micro_batch_size * dp_size

    def eval_batches(self, num_samples, micro_batch_size, dp_rank, dp_size):
        """The first `num_samples` samples (fewer if the data is smaller), split across ranks."""
        num_samples = min(num_samples, self.num_blocks)
        mine = list(range(dp_rank, num_samples, dp_size))
        for k in range(0, len(mine), micro_batch_size):
            yield torch.from_numpy(np.stack([self.sample(i) for i in mine[k : k + micro_batch_size]]))
