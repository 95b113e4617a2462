"""Labelled JSONL for classification tasks (multi-task training).

A sequence-classification file holds {"text": ..., "label": k} lines; a token-classification file
{"tokens": [word, ...], "labels": [k, ...]} lines, one label a word. A word's label goes to its
first token and the others are not scored (IGNORE_INDEX), as Hugging Face's token-classification
recipe does; a word is tokenized after a space (the first word without one), as in the joined text.
Labels are integers in [0, num_labels). Every line is checked when the file is read, before any
model exists; an error names the file and line.

A batch is {"input_ids", "attention_mask", "labels"}, right-padded and cut to seq_len tokens:
labels (micro,) for sequences, (micro, tokens) for tokens. Samples are numbered and split over
data-parallel ranks as packed blocks are (llmstack.data.blocks).
"""

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from llmstack.errors import UserError

from .blocks import SampleSchedule
from .mlm import IGNORE_INDEX
from .pairs import tokenize_texts

KINDS = ("sequence_classification", "token_classification")


def read_labelled(paths: Sequence[str], kind: str, num_labels: int) -> list[dict[str, Any]]:
    """The records of JSONL files of `kind` (KINDS), each line checked."""
    records: list[dict[str, Any]] = []
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"labelled data {path} not found (JSONL, see llmstack.data.labelled)")
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    records.append(_record(line, kind, num_labels, f"{path}:{number}"))
    if not records:
        raise UserError(f"no records in {', '.join(paths)}")
    return records


def _record(line: str, kind: str, num_labels: int, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    if kind == "sequence_classification":
        if not (isinstance(record, dict) and isinstance(record.get("text"), str) and record["text"]):
            raise UserError(f'{where}: expected {{"text": ..., "label": ...}} with a non-empty text')
        labels: Any = [record.get("label")]
    else:
        tokens, labels = (record.get("tokens"), record.get("labels")) if isinstance(record, dict) else (None, None)
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) and t for t in tokens)):
            raise UserError(f'{where}: expected {{"tokens": [word, ...], "labels": [...]}} with non-empty words')
        if not isinstance(labels, list) or len(labels) != len(tokens):
            raise UserError(f"{where}: labels must be a list with one label a word ({len(tokens)} words)")
    if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < num_labels for k in labels):
        raise UserError(f"{where}: labels must be integers in [0, {num_labels}) (the task's num_labels); got {labels}")
    return record


def word_tokens(tokenizer: PreTrainedTokenizerBase, words: Sequence[str], labels: Sequence[int]) -> tuple[list, list]:
    """(token ids, labels) of a labelled word sequence: each word's label on its first token."""
    ids: list[int] = []
    targets: list[int] = []
    for i, (word, label) in enumerate(zip(words, labels)):
        pieces = tokenizer.encode((" " if i else "") + word, add_special_tokens=False)
        ids += pieces
        targets += [label] + [IGNORE_INDEX] * (len(pieces) - 1)
    return ids, targets


class LabelledData(SampleSchedule):
    """Labelled records of JSONL files in a seeded order per epoch; batches as the module docstring says."""

    def __init__(
        self,
        paths: Sequence[str],
        kind: str,
        num_labels: int,
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if tokenizer.pad_token_id is None:
            raise UserError("the tokenizer has no pad token, which batches of texts need")
        self.records = read_labelled(paths, kind, num_labels)
        self.kind, self.tokenizer, self.seq_len = kind, tokenizer, seq_len
        super().__init__(len(self.records), seed, shuffle)

    def item(self, j: int) -> dict[str, Any]:
        return self.records[j]

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.kind == "sequence_classification":
            batch = tokenize_texts(self.tokenizer, [r["text"] for r in items], self.seq_len)
            return {**batch, "labels": torch.tensor([r["label"] for r in items])}
        pairs = [word_tokens(self.tokenizer, r["tokens"], r["labels"]) for r in items]
        length = min(self.seq_len, max(len(ids) for ids, _ in pairs))
        input_ids = torch.full((len(items), length), int(self.tokenizer.pad_token_id))
        labels = torch.full((len(items), length), IGNORE_INDEX)
        mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, (ids, targets) in enumerate(pairs):
            n = min(length, len(ids))
            input_ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(ids[:n]), torch.tensor(targets[:n]), 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def docstring_tasks(corpus: str, out_dir: str) -> dict[str, int]:
    """Two labelled tasks from a JSONL corpus of {"text", "source"} records (llmstack.data.stdlib_corpus):
    `package.jsonl`, whether a docstring's module sits in a package (sequence classification, 2
    labels), and `builtins.jsonl`, which words of its first line are names of Python builtins (token
    classification, 2 labels). Returns the records written per file."""
    import builtins

    names = set(dir(builtins))
    os.makedirs(out_dir, exist_ok=True)
    written = {"package": 0, "builtins": 0}
    with (
        open(corpus, encoding="utf-8") as f,
        open(os.path.join(out_dir, "package.jsonl"), "w", encoding="utf-8") as package,
        open(os.path.join(out_dir, "builtins.jsonl"), "w", encoding="utf-8") as words,
    ):
        for line in f:
            record = json.loads(line)
            package.write(json.dumps({"text": record["text"], "label": int("/" in record["source"])}) + "\n")
            tokens = record["text"].split("\n", 1)[0].split()
            if tokens:
                words.write(json.dumps({"tokens": tokens, "labels": [int(t in names) for t in tokens]}) + "\n")
            written["package"] += 1
            written["builtins"] += bool(tokens)
    return written
