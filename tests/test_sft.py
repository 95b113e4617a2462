import json

import pytest
import torch
import torch.nn.functional as F
from inference_fixtures import tiny_model, tiny_tokenizer

from llmstack.errors import UserError
from llmstack.inference import generate_text
from llmstack.training.evaluate import evaluate_perplexity
from llmstack.training.finetune.lora import add_lora
from llmstack.training.finetune.sft import SFTData

PAIRS = [
    {"prompt": "Q: add(a, b)?\nA:", "response": " return a + b"},
    {"prompt": "Q: the fox?\nA:", "response": " quick brown"},
    {"prompt": "Q: stack?\nA:", "response": " push item"},
    {"prompt": "Q: the dog?\nA:", "response": " lazy"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return path


def test_loss_is_masked_to_the_response_and_eos(tokenizer, jsonl):
    data = SFTData(str(jsonl), tokenizer, seq_len=64, shuffle=False)
    batch = next(data.eval_batches(4, 4, 0, 1))
    for row, pair in enumerate(PAIRS):
        prompt = tokenizer(pair["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(pair["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n = len(prompt) + len(response)
        assert batch["input_ids"][row, :n].tolist() == prompt + response
        assert batch["labels"][row].tolist() == [-100] * len(prompt) + response + [-100] * (
            batch["labels"].shape[1] - n
        )
        assert set(batch["input_ids"][row, n:].tolist()) <= {tokenizer.pad_token_id}

    model = tiny_model()
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model(input_ids=batch["input_ids"]).logits
    targets = batch["labels"][:, 1:]
    by_hand = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, by_hand)
    scored = sum(len(tokenizer(p["response"], add_special_tokens=False)["input_ids"]) + 1 for p in PAIRS)
    assert evaluate_perplexity(model, data.eval_batches(4, 3, 0, 1))["tokens"] == scored


def test_ranks_read_disjoint_examples_in_a_seeded_order(tokenizer, jsonl):
    data = SFTData(str(jsonl), tokenizer, seq_len=64, seed=3)
    seen = [next(data.micro_batches(0, 2, r, 2))["input_ids"] for r in range(2)]
    rows = {tuple(t[t != tokenizer.pad_token_id].tolist()) for s in seen for t in s}
    assert len(rows) == 4  # two ranks x two examples, all different: the whole first epoch
    again = next(SFTData(str(jsonl), tokenizer, seq_len=64, seed=3).micro_batches(0, 2, 0, 2))["input_ids"]
    assert torch.equal(again, seen[0])


def test_lora_fine_tuning_teaches_the_responses(tokenizer, jsonl):
    data = SFTData(str(jsonl), tokenizer, seq_len=64, seed=0)
    model = add_lora(tiny_model(vocab_size=len(tokenizer)), rank=8, alpha=16, dropout=0.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    batches = data.micro_batches(0, 4, 0, 1)
    model.train()
    for _ in range(40):
        model(**next(batches)).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    answers = generate_text(model, tokenizer, [p["prompt"] for p in PAIRS], max_new_tokens=12)
    assert answers == [p["response"] for p in PAIRS]  # and each stopped at EOS


@pytest.mark.parametrize(
    "line, message",
    [("not json", "is not valid JSON"), ('{"prompt": "x"}', 'needs string fields "prompt" and "response"')],
)
def test_bad_lines_are_user_errors_naming_the_line(tmp_path, tokenizer, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + line + "\n")
    with pytest.raises(UserError, match=f"bad.jsonl:2 {message}"):
        SFTData(str(path), tokenizer, seq_len=64)


def test_a_prompt_longer_than_seq_len_is_a_user_error(tokenizer, jsonl):
    with pytest.raises(UserError, match="leaves no room for its response"):
        SFTData(str(jsonl), tokenizer, seq_len=4)
