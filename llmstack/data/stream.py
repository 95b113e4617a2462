"""The training stream: a weighted mixture of document sources read through `datasets` streaming,
tokenized, and packed into fixed `seq_len + 1` blocks, with exact mid-stream resume.

    stream = MixtureStream([{"paths": "web/*.jsonl", "weight": 0.67}, {"paths": "code/*.jsonl", "weight": 0.045}, ...],
                           tokenizer, seq_len=1024, seed=0)
    for batch in stream.micro_batches(consumed_samples, micro_batch_size, dp_rank, dp_size): ...

- Mixture: `interleave_datasets` draws each next document from source i with probability
  weight_i / sum(weights) (a seeded generator), so document counts follow the weights; each source
  repeats when it runs out.
- Sharding: `split_dataset_by_node` gives every data-parallel rank whole files of every source,
  which needs each source's file count to be a multiple of the world size (otherwise every rank
  would read everything and throw most of it away, so that is refused).
- Packing: each document's tokens, then EOS, are appended to a buffer cut into `seq_len + 1`
  blocks; consecutive blocks share one token (as in `PackedBlocks`), so no target is lost.
- Resume: rank r yields its blocks consumed_samples / dp_size onwards. `state_dict()` after a
  micro-batch captures the datasets iterator state and the unfinished token buffer;
  `load_state_dict()` then continues exactly there. Without a saved state the stream replays
  from the start and skips, which gives the same batches, only slower.
The same data-parallel size is needed to resume a stream exactly; pre-tokenized `PackedBlocks`
resume on any world size. Documents come in file order: `datasets` cannot restore a shuffle
buffer exactly, so shuffle when preparing the files, not here.
"""

import numpy as np
import torch

from llmstack.errors import UserError

from .mixture import SourceShare, token_shares
from .reader import read_documents


class MixtureStream:
    def __init__(self, sources, tokenizer, seq_len, seed=0, tokenize_batch=64):
        if not sources:
            raise UserError("the stream needs at least one source: [{paths: ..., weight: ...}]")
        weights = [float(s.get("weight", 1.0)) for s in sources]
        if min(weights) <= 0:
            raise UserError(f"stream source weights must be positive; got {weights}")
        self.sources = sources
        self.probabilities = [w / sum(weights) for w in weights]
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.seq_len, self.seed, self.tokenize_batch = seq_len, seed, tokenize_batch
        self._saved = self._current = None
        self.names = [str(s.get("name", s["paths"])) for s in sources]
        self.source_tokens = dict.fromkeys(self.names, 0)  # tokens this stream has read, by source

    def documents(self, dp_rank=0, dp_size=1):
        """This rank's endless mixture of documents, as a `datasets.IterableDataset` of {"text", "source"}."""
        from datasets import interleave_datasets
        from datasets.distributed import split_dataset_by_node

        parts = []
        for source, name in zip(self.sources, self.names):
            docs = read_documents(source["paths"], source.get("text_field", "text"),
                                  source.get("text_unit", "document"), source=name)
            if docs.num_shards % dp_size:
                raise UserError(
                    f"stream source {source['paths']} has {docs.num_shards} files, not a multiple of the "
                    f"data-parallel size {dp_size}: split it into a multiple of {dp_size} files so that "
                    f"each rank reads whole files of its own")
            parts.append(split_dataset_by_node(docs, dp_rank, dp_size).repeat(None))
        return interleave_datasets(parts, probabilities=self.probabilities, seed=self.seed,
                                   stopping_strategy="first_exhausted")

    def _token_lists(self, dp_rank, dp_size):
        def tokenize(batch):
            ids = self.tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            return {"ids": [x + [self.eos] for x in ids]}

        return self.documents(dp_rank, dp_size).map(tokenize, batched=True, batch_size=self.tokenize_batch,
                                                     remove_columns=["text"])

    def micro_batches(self, consumed_samples, micro_batch_size, dp_rank, dp_size):
        """Endless (micro_batch_size, seq_len + 1) LongTensors of this rank's blocks, from global
        sample `consumed_samples` on (a multiple of dp_size, as the trainer counts samples)."""
        if consumed_samples % dp_size:
            raise UserError(f"consumed_samples ({consumed_samples}) must be a multiple of dp_size ({dp_size})")
        position = consumed_samples // dp_size
        token_lists = self._token_lists(dp_rank, dp_size)
        saved, self._saved = self._saved, None
        buffer, done = [], 0
        if saved and (saved["dp_rank"], saved["dp_size"], saved["position"]) == (dp_rank, dp_size, position):
            token_lists.load_state_dict(saved["dataset"])
            buffer, done = list(saved["buffer"]), position
        documents = iter(token_lists)
        width, batch = self.seq_len + 1, []
        while True:
            while len(buffer) < width:
                document = next(documents, None)
                if document is None:
                    raise UserError(f"the stream's sources hold no documents for data-parallel rank {dp_rank}")
                buffer.extend(document["ids"])
                self.source_tokens[document["source"]] += len(document["ids"])
            block, buffer = buffer[:width], buffer[self.seq_len:]
            done += 1
            if done <= position:  # replaying up to the resume point
                continue
            batch.append(block)
            if len(batch) == micro_batch_size:
                self._current = {"dataset": token_lists, "buffer": buffer, "position": done,
                                 "dp_rank": dp_rank, "dp_size": dp_size}
                yield torch.tensor(np.array(batch, dtype=np.int64))
                batch = []

    def token_shares(self) -> list[SourceShare]:
        """Each source's share of the tokens read so far (by this process) against its weight;
        `mixture.unbalanced(shares)` warns about those more than 20% off their targets."""
        return token_shares(self.source_tokens, dict(zip(self.names, self.probabilities)))

    def state_dict(self):
        """Where the running `micro_batches` generator is, after the micro-batch it last yielded."""
        if self._current is None:
            raise RuntimeError("state_dict() describes a running micro_batches(); none has yielded yet")
        current = self._current
        return {**current, "dataset": current["dataset"].state_dict(), "buffer": list(current["buffer"])}

    def load_state_dict(self, state):
        """Resume from `state` at the next `micro_batches` call whose start matches it."""
        self._saved = state
