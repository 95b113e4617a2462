"""The training stream: a weighted mixture of named document sources read through `datasets`
streaming, tokenized, and packed into fixed `seq_len + 1` blocks, with exact mid-stream resume.

    stream = MixtureStream([{"name": "web", "paths": "web/*.jsonl", "weight": 0.67},
                            {"name": "code", "paths": "code/*.jsonl", "weight": 0.045}, ...],
                           tokenizer, seq_len=1024, seed=0)
    for batch in stream.micro_batches(consumed_samples, micro_batch_size, dp_rank, dp_size): ...

- Mixture by tokens (`weight_by="tokens"`, the default): a source's weight is its share of the
  tokens. Each source is tokenized on its own and the next document comes from the source that is
  furthest behind its share of the tokens drawn so far once half of its next document is counted
  (a deterministic deficit rule), so each source's token count stays within about one document of
  its target at every point of the stream, whatever its documents' lengths.
- Mixture by documents (`weight_by="documents"`): `interleave_datasets` draws each next document
  from source i with probability weight_i / sum(weights) (a seeded generator), so document counts
  follow the weights and token shares follow them only when mean document lengths are equal.
  Each source repeats when it runs out, in both modes.
- Sharding: `split_dataset_by_node` gives every data-parallel rank whole files of every source,
  which needs each source's file count to be a multiple of the world size (otherwise every rank
  would read everything and throw most of it away, so that is refused).
- Packing: each document's tokens, then EOS, are appended to a buffer cut into `seq_len + 1`
  blocks; consecutive blocks share one token (as in `PackedBlocks`), so no target is lost.
- Resume: rank r yields its blocks consumed_samples / dp_size onwards. `state_dict()` after a
  micro-batch captures where each source's reader stands and the unfinished token buffer;
  `load_state_dict()` then continues exactly there, at a cost that does not grow with the stream
  position. By tokens, each source's reader seeks to its place in its current file (a byte
  offset in JSONL and text, a row group and row in Parquet; gzip files from a seek point at most
  1 MiB before it, zstd files from the start of its frame, see `llmstack.data.seekable`), and
  at most `tokenize_batch` documents a source are tokenized again. By documents,
  the state is `datasets`' (file and row of every source, the mixture's generator): it re-reads
  (without tokenizing) the current file of each source up to its row. Without a saved state the stream
  replays from the start and skips, which gives the same batches, only in time proportional to
  the position.
Each rank reads its own files, so a stream resumes only on the data-parallel size that saved it:
another size is refused (`check_data_parallel_size`) rather than repeating or skipping
documents; pre-tokenized `PackedBlocks` resume on any world size. Documents come in file order:
`datasets` cannot restore a shuffle buffer exactly, so shuffle when preparing the files, not here.
"""

import dataclasses
import itertools
import json
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from llmstack.errors import UserError

from .documents import causal_batch, run_starts
from .mixture import SourceShare, WeightSchedule, check_weight_by, source_names, token_shares, weights_of
from .reader import expand_paths, plan_shards, read_documents, read_shard
from .report import StageStats
from .seekable import SeekPoint

STREAM_SOURCE_KEYS = ("text_field", "text_unit")

logger = logging.getLogger(__name__)


def check_data_parallel_size(saved_dp_size: int, dp_size: int) -> None:
    """Refuse to continue a stream saved by `saved_dp_size` data-parallel ranks on `dp_size`:
    the files each rank reads, and where it stands in them, are tied to the number of ranks."""
    if saved_dp_size != dp_size:
        raise UserError(
            f"this run's data stream (data.sources) was saved by {saved_dp_size} data-parallel ranks, each "
            f"reading its own share of the files; continuing on {dp_size} would repeat or skip documents. "
            f"Resume with {saved_dp_size} data-parallel ranks (world size = {saved_dp_size} x tensor x "
            "pipeline parallel size). A run that must change its number of ranks mid-way trains from "
            "packed shards (`llmstack data pack`, data.train), which resume on any number of ranks"
        )


class MixtureStream:
    def __init__(
        self,
        sources: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        seq_len: int,
        seed: int = 0,
        tokenize_batch: int = 64,
        weight_by: str = "tokens",
        schedule: Mapping[str, Any] | None = None,
        samples_per_step: int = 1,
        document_masking: bool = False,
    ) -> None:
        self.names = source_names(sources, "paths", STREAM_SOURCE_KEYS)
        self.document_masking = document_masking  # batches carry their documents (see llmstack.data.documents)
        self.weight_by = check_weight_by(weight_by)
        self.sources = sources
        self.probabilities = weights_of(sources)
        if schedule and self.weight_by == "documents":
            raise UserError(
                "data.schedule schedules shares of the tokens: a stream follows it with data.weight_by: tokens "
                "(the default), not documents"
            )
        self.schedule = WeightSchedule.from_config(schedule, self.names, self.probabilities, "data.schedule")
        self.samples_per_step = samples_per_step  # global samples of one training step
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.seq_len, self.seed, self.tokenize_batch = seq_len, seed, tokenize_batch
        self._saved: dict[str, Any] | None = None
        self._current: dict[str, Any] | None = None

    @property
    def settings(self) -> dict:
        """What decides the stream's contents; a saved state continues only a stream with the same.
        A stream by documents has the settings streams had before `weight_by` existed, so their
        checkpoints resume with weight_by="documents"."""
        settings = {
            "sources": self.sources,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "tokenize_batch": self.tokenize_batch,
        }
        return settings if self.weight_by == "documents" else {**settings, "weight_by": self.weight_by}

    def documents(self, dp_rank: int = 0, dp_size: int = 1) -> Any:
        """This rank's endless mixture of documents by count (weight_by="documents"), as a
        `datasets.IterableDataset` of {"text", "source"}."""
        from datasets import interleave_datasets

        return interleave_datasets(
            self._parts(dp_rank, dp_size),
            probabilities=self.probabilities,
            seed=self.seed,
            stopping_strategy="first_exhausted",
        )

    def _parts(self, dp_rank: int, dp_size: int) -> list[Any]:
        """This rank's endless documents of each source, as `datasets.IterableDataset`s of {"text", "source"}."""
        from datasets.distributed import split_dataset_by_node

        parts = []
        for source, name in zip(self.sources, self.names):
            docs = read_documents(
                source["paths"], source.get("text_field", "text"), source.get("text_unit", "document"), source=name
            )
            self._check_files(source, docs.num_shards, dp_size)
            parts.append(split_dataset_by_node(docs, dp_rank, dp_size).repeat(None))
        return parts

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's tokens, then EOS."""
        return [x + [self.eos] for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _token_lists(self, dp_rank: int, dp_size: int) -> "DocumentsByCount | DocumentsByTokens":
        """This rank's tokenized documents ({"ids", "source"}), mixed as `weight_by` says."""
        if self.weight_by == "documents":
            documents = self.documents(dp_rank, dp_size).map(
                lambda batch: {"ids": self._encode(batch["text"])},
                batched=True,
                batch_size=self.tokenize_batch,
                remove_columns=["text"],
            )
            return DocumentsByCount(documents)
        parts = []
        for source, name in zip(self.sources, self.names):
            files = expand_paths(source["paths"])
            self._check_files(source, len(files), dp_size)
            shards = plan_shards(
                [{**{k: source[k] for k in STREAM_SOURCE_KEYS if k in source}, "paths": files[dp_rank::dp_size]}],
                shard_bytes=sys.maxsize,
            )
            parts.append(SourceDocuments(shards, name, self._encode, self.tokenize_batch))
        return DocumentsByTokens(parts, self.schedule)

    @staticmethod
    def _check_files(source: Mapping[str, Any], files: int, dp_size: int) -> None:
        if files % dp_size:
            raise UserError(
                f"stream source {source['paths']} has {files} files, not a multiple of the "
                f"data-parallel size {dp_size}: split it into a multiple of {dp_size} files so that "
                f"each rank reads whole files of its own"
            )

    def micro_batches(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> Iterator[Any]:
        """Endless (micro_batch_size, seq_len + 1) LongTensors of this rank's blocks, from global
        sample `consumed_samples` on (a multiple of dp_size, as the trainer counts samples); with
        document masking, their `documents.causal_batch`es (each block's document starts are
        where the documents appended to the buffer begin)."""
        if consumed_samples % dp_size:
            raise UserError(f"consumed_samples ({consumed_samples}) must be a multiple of dp_size ({dp_size})")
        position = consumed_samples // dp_size
        token_lists = self._token_lists(dp_rank, dp_size)
        saved, self._saved, self._current = self._saved, None, None
        buffer: list[int] = []
        owners: list[list] = []  # runs of [source name, tokens] along the buffer (None: not known)
        counts = dict.fromkeys(self.names, 0)
        done = 0
        if saved is not None and self._usable(saved, dp_rank, dp_size, position):
            token_lists.load_state_dict(saved["dataset"])
            buffer, done = list(saved["buffer"]), position
            owners = [list(run) for run in saved.get("owners", [[None, len(buffer)]])]
            counts.update(saved.get("source_tokens", {}))
        elif position:
            logger.warning(
                "data-parallel rank %d has no saved stream state to continue from: replaying and "
                "re-tokenizing the stream up to block %d (time grows with the position)",
                dp_rank,
                position,
            )
        documents = iter(token_lists)
        width, batch = self.seq_len + 1, []
        starts: list[Any] = []  # each block's document starts (document masking)
        blocks_per_step = self.samples_per_step / dp_size
        while True:
            token_lists.step = done / blocks_per_step  # the step whose block the next document fills
            while len(buffer) < width:
                document = next(documents, None)
                if document is None:
                    raise UserError(f"the stream's sources hold no documents for data-parallel rank {dp_rank}")
                buffer.extend(document["ids"])
                owners.append([document["source"], len(document["ids"])])
            block, buffer = buffer[:width], buffer[self.seq_len :]
            block_starts = run_starts([length for _, length in owners], self.seq_len) if self.document_masking else None
            take_tokens(owners, self.seq_len, counts)
            done += 1
            if done <= position:  # replaying up to the resume point
                continue
            batch.append(block)
            starts.append(block_starts)
            if len(batch) == micro_batch_size:
                self._current = {
                    "dataset": token_lists,
                    "buffer": buffer,
                    "owners": owners,
                    "source_tokens": dict(counts),
                    "position": done,
                    "dp_rank": dp_rank,
                    "dp_size": dp_size,
                }
                blocks = np.array(batch, dtype=np.int64)
                yield causal_batch(blocks, np.stack(starts)) if self.document_masking else torch.tensor(blocks)
                batch, starts = [], []

    @property
    def source_tokens(self) -> dict[str, int]:
        """Tokens of the blocks yielded so far (each block's first seq_len tokens: the positions it
        trains), by source; saved with the stream's state, so the counts run on across a resume."""
        current = self._current
        return dict(current["source_tokens"]) if current is not None else dict.fromkeys(self.names, 0)

    def token_shares(self) -> list[SourceShare]:
        """Each source's share of the tokens yielded so far (by this process) against its weight
        (its scheduled share over the steps so far, under a schedule); `mixture.unbalanced(shares)`
        warns about those more than 20% off their targets."""
        current = self._current
        position = current["position"] / (self.samples_per_step / current["dp_size"]) if current else 0.0
        return token_shares(self.source_tokens, self.expected_shares(position))

    def expected_shares(self, step: float) -> dict[str, float]:
        """Each source's scheduled share of the tokens of steps [0, step) (at step 0: its share there)."""
        expected = self.schedule.integral(step) if step > 0 else self.schedule.at(0)
        return dict(zip(self.names, map(float, expected)))

    def _continues(self, saved: dict) -> bool:
        """Whether a stream saved with `saved` settings continues as this one. By documents the
        settings must be equal; by tokens, sources may be reweighted, added or removed (matched by
        name), but a source kept under its name must read the same files the same way."""
        now = json_round_trip(self.settings)
        if self.weight_by == "documents" or saved.get("weight_by") != self.weight_by:
            return saved == now
        if {k: v for k, v in saved.items() if k != "sources"} != {k: v for k, v in now.items() if k != "sources"}:
            return False
        names = source_names(saved["sources"], "paths", STREAM_SOURCE_KEYS, "the checkpoint's data.sources")
        before = {n: {k: v for k, v in s.items() if k != "weight"} for n, s in zip(names, saved["sources"])}
        after = {n: {k: v for k, v in s.items() if k != "weight"} for n, s in zip(self.names, now["sources"])}
        return all(before[n] == spec for n, spec in after.items() if n in before)

    def _usable(self, saved: dict, dp_rank: int, dp_size: int, position: int) -> bool:
        """Whether `saved` continues this rank's stream at `position`; refuses one that cannot be
        continued exactly. A state of another data-parallel rank (a rank whose tensor/pipeline
        layout changed) is not used: the stream is replayed instead, which is exact."""
        if not self._continues(saved["settings"]):
            saved_by = saved["settings"].get("weight_by", "documents")
            if saved_by != self.weight_by:
                raise UserError(
                    f"this run's data stream was saved weighting its sources by {saved_by} and data.weight_by "
                    f"is now {self.weight_by}: set data.weight_by={saved_by} to resume it (streams saved "
                    "before data.weight_by existed weighted by documents)"
                )
            raise UserError(
                f"the data stream's settings differ from the checkpoint's ({saved['settings']}); put data.sources, "
                "data.seq_len and data.seed back as they were to resume this run (a stream by tokens may change "
                "its sources' weights and add or remove sources, but a source keeps its files under its name)"
            )
        check_data_parallel_size(saved["dp_size"], dp_size)
        if saved["position"] != position:
            raise ValueError(
                f"the saved stream state is at block {saved['position']} of this rank, not {position}: "
                "it belongs to another checkpoint"
            )
        return saved["dp_rank"] == dp_rank

    def state_dict(self) -> dict | None:
        """Where the running `micro_batches` generator is, after the micro-batch it last yielded
        (JSON-serializable); None when it has yielded none (a pipeline stage that reads no data)."""
        current = self._current
        if current is None:
            return None
        return {
            **current,
            "dataset": current["dataset"].state_dict(),
            "buffer": list(current["buffer"]),
            "owners": [list(run) for run in current["owners"]],
            "source_tokens": dict(current["source_tokens"]),
            "settings": self.settings,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (a `state_dict()`) at the next `micro_batches` call, which must
        start at the position it was saved at."""
        self._saved = state


class DocumentsByCount:
    """Documents as `datasets.interleave_datasets` mixes them (by count), with its resume state."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.step = 0.0  # not used: the weights by documents do not change

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.dataset)

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


class SourceDocuments:
    """One source's documents on one data-parallel rank (its `shards`, whole files, over and over),
    tokenized `batch` at a time, as {"ids", "source"}. The state after a document is where its
    file's reader continues (`Document.position`: a byte offset in JSONL and text files, a row in
    Parquet), so a resume seeks there: its cost does not grow with the position in the file (a
    gzip or zstd file is decompressed from the seek point before it, `Document.seek`: at most
    `seekable.GZIP_SPACING` bytes before it in gzip, the start of its frame in zstd). At most
    `batch` documents are tokenized again."""

    def __init__(self, shards: Sequence[Any], name: str, encode: Any, batch: int) -> None:
        self.shards, self.name, self.encode, self.batch = list(shards), name, encode, batch
        self._state: dict[str, int] = {"epoch": 0, "file": 0, "position": 0}
        self._seek: SeekPoint | None = None  # a compressed file's decompressor restarts there

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, k, position = self._state["epoch"], self._state["file"], self._state["position"]
        seek = self._seek
        found = k or position  # a pass resumed mid-way proves nothing about the files before it
        while self.shards:
            documents = read_shard(dataclasses.replace(self.shards[k], start=position), StageStats(), seek=seek)
            while batch := list(itertools.islice(documents, self.batch)):
                found = True
                for document, ids in zip(batch, self.encode([d.text for d in batch])):
                    self._state = {"epoch": epoch, "file": k, "position": document.position}
                    self._seek = document.seek
                    yield {"ids": ids, "source": self.name}
            k, position, seek = k + 1, 0, None
            if k == len(self.shards):
                if not found:
                    return
                epoch, k, found = epoch + 1, 0, False

    def state_dict(self) -> dict[str, Any]:
        """Where the reader continues after the document last yielded: {epoch, file, position},
        and in a gzip/zstd file the decompressor's seek point before it (`seek`: offsets, and for
        gzip the 32 KiB before the point, deflated and base64-encoded: 16 KB of JSON for English
        prose, 44 KB at most)."""
        state: dict[str, Any] = dict(self._state)
        if self._seek is not None:
            state["seek"] = self._seek.to_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = {k: v for k, v in state.items() if k != "seek"}
        self._seek = SeekPoint.from_dict(state["seek"]) if "seek" in state else None


class DocumentsByTokens:
    """Documents of several sources mixed so that each source's share of the tokens follows its
    scheduled share at the current `step` (set by the reader before it pulls a document): each
    source's target grows by its share of every document drawn, and the next document is the
    head of the source furthest behind its target once half of that head is counted, relative to
    its share, (target - drawn - head / 2) / share, ties going to the first source; a source of
    share 0 is not drawn. Drawn tokens then stay within about one document of the target, for
    every source at every point. (With constant weights w this is the smallest
    (drawn + head / 2) / w.) The state (JSON) is, by source name, each reader's place, its head
    document, the tokens drawn, the targets, and the schedule.

    A state saved with another schedule (other weights) or other sources continues with this
    one: a source kept by name goes on from its place and head (no document of it is repeated or
    skipped), a new one starts at its beginning, a removed one is left; every target starts again
    from what its source has drawn, so the new mixture holds from the resume on."""

    def __init__(self, parts: Sequence[Any], schedule: WeightSchedule) -> None:
        self.parts, self.schedule, self.names = list(parts), schedule, schedule.names
        self.drawn = [0] * len(self.parts)
        self.targets = [0.0] * len(self.parts)
        self.heads: list[dict[str, Any] | None] = [None] * len(self.parts)
        self.step = 0.0
        self._saved: dict | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        saved, self._saved = self._saved, None
        if saved is not None:
            self._restore(saved)
        iterators = [iter(part) for part in self.parts]
        for i, head in enumerate(self.heads):
            if head is None:
                self.heads[i] = next(iterators[i], None)
        while all(head is not None for head in self.heads):
            shares = self.schedule.at(self.step).tolist()
            i = max(
                (k for k in range(len(self.parts)) if shares[k] > 0),
                key=lambda k: (self.targets[k] - self.drawn[k] - len(self.heads[k]["ids"]) / 2) / shares[k],  # type: ignore[index]
            )
            document = self.heads[i]
            assert document is not None
            self.drawn[i] += len(document["ids"])
            self.targets = [t + share * len(document["ids"]) for t, share in zip(self.targets, shares)]
            self.heads[i] = next(iterators[i], None)
            yield document

    def _restore(self, saved: dict) -> None:
        for i, name in enumerate(self.names):
            if name in saved["parts"]:
                self.parts[i].load_state_dict(saved["parts"][name])
                self.heads[i] = saved["heads"][name]
        if "schedule" not in saved:  # saved with constant weights, before schedules
            names, weights = list(saved["weights"]), list(saved["weights"].values())
            drawn = sum(saved["drawn"].values())
            saved = {**saved, "schedule": WeightSchedule.constant(names, weights).to_dict()}
            saved["targets"] = {n: w / sum(weights) * drawn for n, w in zip(names, weights)}
        self.drawn = [saved["drawn"].get(name, 0) for name in self.names]
        same = saved["schedule"] == json_round_trip(self.schedule.to_dict())
        self.targets = [saved["targets"][name] if same else float(d) for name, d in zip(self.names, self.drawn)]

    def state_dict(self) -> dict:
        """Where the mixture stands after the document it last yielded."""
        return {
            "parts": {name: part.state_dict() for name, part in zip(self.names, self.parts)},
            "heads": {name: None if head is None else dict(head) for name, head in zip(self.names, self.heads)},
            "drawn": dict(zip(self.names, self.drawn)),
            "targets": dict(zip(self.names, self.targets)),
            "schedule": self.schedule.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after the document `state` was saved at, on the next iteration."""
        self._saved = state


def take_tokens(owners: list[list], n: int, counts: dict[str, int]) -> None:
    """Remove the first `n` tokens from `owners` (runs of [source, tokens]), adding them to their
    sources' `counts` (a run of unknown source, None, is not counted)."""
    while n:
        source, length = owners[0]
        taken = min(n, length)
        if source is not None:
            counts[source] += taken
        n -= taken
        if taken == length:
            owners.pop(0)
        else:
            owners[0][1] -= taken


def json_round_trip(value: object) -> Any:
    """`value` as it reads back from JSON (tuples become lists), to compare it with a saved one."""
    return json.loads(json.dumps(value))
