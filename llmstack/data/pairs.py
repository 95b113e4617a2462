"""(query, positive) pairs from JSONL for contrastive training, or single texts for SimCSE.

Each line of a pairs file is {"query": ..., "positive": ...}; each line of an unsupervised file
is {"text": ...}, which becomes the pair (text, text): the two copies differ only by dropout
(SimCSE). One run's files are all of one kind. Every line is checked when the files are read,
before any model exists; an error names the file and line.

A batch is one forward pass of 2 x micro texts: {"input_ids", "attention_mask"}, right-padded,
the queries in its first half and their positives, in the same order, in its second. Samples
are numbered and split over data-parallel ranks as packed blocks are (llmstack.data.blocks):
the ranks' micro-batches, side by side, are one process's micro-batch of their total size.
"""

import json
import os
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from llmstack.errors import UserError

from .blocks import SampleSchedule

PAIR_KEYS = ("query", "positive")
TEXT_KEY = "text"


def read_pairs(paths: Sequence[str]) -> tuple[list[tuple[str, str]], bool]:
    """(pairs, unsupervised) from JSONL files; unsupervised: the files hold single texts (SimCSE)."""
    pairs: list[tuple[str, str]] = []
    kinds = set()
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"pairs file {path} not found (JSONL of {{query, positive}} or {{text}} records)")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                pair, kind = _record_pair(line, f"{path}:{number}")
                pairs.append(pair)
                kinds.add(kind)
    if not pairs:
        raise UserError(f"no pairs in {', '.join(paths)}")
    if len(kinds) > 1:
        raise UserError(f"{', '.join(paths)} mix {{query, positive}} pairs and {{text}} records: give one kind")
    return pairs, kinds == {"text"}


def _record_pair(line: str, where: str) -> tuple[tuple[str, str], str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    if isinstance(record, dict) and all(isinstance(record.get(k), str) and record[k] for k in PAIR_KEYS):
        return (record["query"], record["positive"]), "pair"
    if isinstance(record, dict) and isinstance(record.get(TEXT_KEY), str) and record[TEXT_KEY]:
        return (record[TEXT_KEY], record[TEXT_KEY]), "text"
    raise UserError(f'{where}: expected {{"query": ..., "positive": ...}} or {{"text": ...}} with non-empty strings')


def tokenize_texts(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int
) -> dict[str, torch.Tensor]:
    """Right-padded {"input_ids", "attention_mask"} of `texts`, each cut to `max_length` tokens:
    the call sentence-transformers makes, so that an exported model sees the same tokens."""
    tokenizer.padding_side = "right"
    encoded = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


class PairData(SampleSchedule):
    """Pairs of JSONL files in a seeded order per epoch; batches as the module docstring says."""

    def __init__(
        self,
        paths: Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.pairs, self.unsupervised = read_pairs(paths)
        if tokenizer.pad_token_id is None:
            raise UserError("the tokenizer has no pad token, which batches of texts need")
        self.tokenizer, self.seq_len = tokenizer, seq_len
        super().__init__(len(self.pairs), seed, shuffle)

    def item(self, j: int) -> tuple[str, str]:
        return self.pairs[j]

    def collate(self, items: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        queries, positives = zip(*items)
        return tokenize_texts(self.tokenizer, [*queries, *positives], self.seq_len)


def split_pairs(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(queries, positives) halves of a pair batch."""
    half = batch["input_ids"].shape[0] // 2
    return {k: v[:half] for k, v in batch.items()}, {k: v[half:] for k, v in batch.items()}


def summary_pairs(corpus: str, out: str, text_field: str = "text") -> int:
    """Write (first paragraph, rest) of each JSONL document with more than one paragraph as a
    {query, positive} pair to `out` (e.g. a docstring's summary line and its body: a retrieval
    task from any text corpus); returns the pairs written."""
    written = 0
    with open(corpus, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as w:
        for line in f:
            summary, _, rest = json.loads(line)[text_field].strip().partition("\n\n")
            if summary.strip() and rest.strip():
                w.write(json.dumps({"query": summary.strip(), "positive": rest.strip()}) + "\n")
                written += 1
    return written
