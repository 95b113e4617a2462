"""Supervised fine-tuning data: prompt/response pairs from JSONL, with the loss on the response only.

Each line is an object such as {"prompt": "Q: 2+2?\\nA:", "response": " 4"}. A pair becomes the
prompt's tokens then the response's tokens and EOS (so the model learns to stop); its labels are
-100 over the prompt, so only the response is scored. Prompt and response are tokenized apart,
as the prompt will be at generation time.

`SFTData` serves the examples through the same interface as `llmstack.data.blocks.PackedBlocks`
(`num_blocks`, `micro_batches`, `eval_batches`, numbered globally in a seeded order per epoch),
so the trainer runs fine-tuning as it runs pretraining. Its batches are dicts of `input_ids` and
`labels`, padded on the right: under causal attention no real token sees the padding, so no
attention mask is needed. Responses differ in length; the trainer divides the summed token loss by
the target count of the whole optimizer step (see `Trainer.train_step`), so every response token
weighs the same whichever micro-batch or rank it came in.
"""

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from llmstack.data.blocks import SampleSchedule
from llmstack.data.pack import expand_paths
from llmstack.errors import UserError
from llmstack.models.loss import IGNORE_INDEX


def read_pairs(
    paths: str | Iterable[str | Path], prompt_field: str = "prompt", response_field: str = "response"
) -> list[tuple[str, str]]:
    """(prompt, response) strings from JSONL files (paths or globs)."""
    pairs = []
    for path in expand_paths(paths):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where} is not valid JSON ({e})") from None
                if not isinstance(record, dict) or not all(
                    isinstance(record.get(k), str) for k in (prompt_field, response_field)
                ):
                    raise UserError(f'{where} needs string fields "{prompt_field}" and "{response_field}"')
                pairs.append((record[prompt_field], record[response_field]))
    if not pairs:
        raise UserError(f"no prompt/response pairs in {paths}")
    return pairs


def encode_pair(
    tokenizer: PreTrainedTokenizerBase, prompt: str, response: str, max_len: int
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one pair, cut to max_len tokens; labels are -100 over the prompt."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(prompt_ids) >= max_len:
        raise UserError(
            f"a prompt of {len(prompt_ids)} tokens leaves no room for its response in seq_len={max_len} "
            f"(prompt starts {prompt[:40]!r}); shorten it or raise data.seq_len"
        )
    input_ids = (prompt_ids + response_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_len]
    return input_ids, labels


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (input_ids, labels) examples into a {"input_ids", "labels"} batch."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
    return {"input_ids": input_ids, "labels": labels}


class SFTData(SampleSchedule):
    """Prompt/response examples served in PackedBlocks' order and slicing; batches are the model's
    keyword arguments ({"input_ids", "labels"}), right-padded."""

    def __init__(
        self,
        paths: str | Iterable[str | Path],
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        prompt_field: str = "prompt",
        response_field: str = "response",
    ) -> None:
        pairs = read_pairs(paths, prompt_field, response_field)
        self.examples = [encode_pair(tokenizer, p, r, seq_len) for p, r in pairs]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        super().__init__(len(self.examples), seed, shuffle)

    def item(self, j: int) -> tuple[list[int], list[int]]:
        return self.examples[j]

    def collate(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        return collate(examples, self.pad_token_id)
