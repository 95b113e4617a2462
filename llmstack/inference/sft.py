"""Supervised fine-tuning data: prompt/response pairs from JSONL, with the loss on the response only.

Each line is an object such as {"prompt": "Q: 2+2?\\nA:", "response": " 4"}. A pair becomes the
prompt's tokens then the response's tokens and EOS (so the model learns to stop); its labels are
-100 over the prompt, so only the response is scored. Prompt and response are tokenized apart,
as the prompt will be at generation time.

`SFTData` serves the examples through the same interface as `llmstack.data.blocks.PackedBlocks`
(`num_blocks`, `micro_batches`, `eval_batches`, numbered globally in a seeded order per epoch),
so the trainer runs fine-tuning as it runs pretraining. Its batches are dicts of `input_ids` and
`labels`, padded on the right: under causal attention no real token sees the padding, so no
attention mask is needed.
"""

import json

import numpy as np
import torch

from llmstack.data.pack import expand_paths
from llmstack.errors import UserError
from llmstack.models.modeling_llmstack import IGNORE_INDEX


def read_pairs(paths, prompt_field="prompt", response_field="response"):
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


def encode_pair(tokenizer, prompt, response, max_len):
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


def collate(examples, pad_token_id):
    """Right-pad (input_ids, labels) examples into a {"input_ids", "labels"} batch."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
    return {"input_ids": input_ids, "labels": labels}


class SFTData:
    def __init__(self, paths, tokenizer, seq_len, seed=0, shuffle=True, prompt_field="prompt", response_field="response"):
        pairs = read_pairs(paths, prompt_field, response_field)
        self.examples = [encode_pair(tokenizer, p, r, seq_len) for p, r in pairs]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.seed = seed
        self.shuffle = shuffle
        self._epoch, self._order = None, None

    @property
    def num_blocks(self):
        return len(self.examples)

    def __len__(self):
        return self.num_blocks

    def sample(self, i):
        """Global sample i: example order[i mod N] of epoch i // N."""
        epoch, j = divmod(i, self.num_blocks)
        if not self.shuffle:
            return self.examples[j]
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng(self.seed + epoch).permutation(self.num_blocks)
        return self.examples[int(self._order[j])]

    def micro_batches(self, consumed_samples, micro_batch_size, dp_rank, dp_size):
        """Endless batches for one data-parallel rank, addressed as PackedBlocks.micro_batches."""
        start = consumed_samples + dp_rank * micro_batch_size
        while True:
            yield collate([self.sample(start + i) for i in range(micro_batch_size)], self.pad_token_id)
            start += micro_batch_size * dp_size

    def eval_batches(self, num_samples, micro_batch_size, dp_rank, dp_size):
        """The first `num_samples` examples (fewer if there are fewer), split across ranks."""
        mine = list(range(dp_rank, min(num_samples, self.num_blocks), dp_size))
        for k in range(0, len(mine), micro_batch_size):
            yield collate([self.sample(i) for i in mine[k : k + micro_batch_size]], self.pad_token_id)
