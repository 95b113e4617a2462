"""Document masking (data.document_masking): packed samples carry their documents' boundaries,
attention stays inside a document and RoPE positions restart at each one. A packed batch's summed
loss and gradients equal those of its documents run one by one (decoder and masked-LM encoder),
the option off reproduces the old loss bit for bit, and a Trainer run trains and evaluates."""

import json

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL, tiny_run_config

from llmstack.data.blocks import MixedBlocks, PackedBlocks
from llmstack.data.documents import block_starts, document_fields, run_starts
from llmstack.data.indexed import IndexedDatasetWriter
from llmstack.data.mlm import IGNORE_INDEX, MaskedBlocks
from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackEncoderConfig, LLMStackForCausalLM, LLMStackForMaskedLM

VOCAB, EOS = 64, 1


def tiny(cls=LLMStackForCausalLM, config_cls=LLMStackConfig, **overrides):
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, num_key_value_heads=2, **{**TINY_MODEL, **overrides})
    return cls(config).float()


def documents(lengths, seed=0):
    """Token documents of these lengths, each ending with EOS (which may also occur inside one)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, VOCAB, n - 1), EOS) for n in lengths]
    docs[1][2] = EOS  # an EOS inside a document is not a boundary: the index says where documents are
    return docs


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("docmask") / "train"
    with IndexedDatasetWriter(prefix) as writer:
        for doc in documents([5, 9, 3, 14, 7, 11, 6]):
            writer.add_document(doc)
    return str(prefix)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def max_difference(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def pieces(starts):
    """(start, end) of each document of one sample's starts."""
    edges = [*np.flatnonzero(starts), len(starts)]
    return list(zip(edges[:-1], edges[1:]))


def test_batches_carry_the_documents_of_the_index_not_eos(shard):
    blocks = PackedBlocks(shard, seq_len=12, shuffle=False, document_masking=True)
    batch = blocks.collate([blocks.sample(i) for i in range(len(blocks))])
    plain = PackedBlocks(shard, seq_len=12, shuffle=False)
    tokens = plain.collate([plain.sample(i) for i in range(len(plain))])
    assert torch.equal(batch["input_ids"], tokens[:, :-1]) and torch.equal(batch["shift_labels"], tokens[:, 1:])
    # documents start at 0, 5, 14, 17, 31, 38, 49; sample 1 covers tokens 12..23 (cut at both ends)
    assert batch["document_ids"][1].tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    assert batch["position_ids"][1].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]  # the inner EOS at 7 is no start
    assert block_starts(np.array([0, 5, 14]), 12, 4).tolist() == [True, False, True, False]
    assert run_starts([2, 3, 10], 6).tolist() == [True, False, True, False, False, True]
    mixed = MixedBlocks([{"prefixes": [shard], "weight": 1.0}], seq_len=12, document_masking=True)
    assert set(mixed.collate([mixed.sample(0)])) == {"input_ids", "shift_labels", "position_ids", "document_ids"}


def packed_and_alone(shard, seq_len=24):
    """A packed batch of two samples (documents cut by both sample boundaries) and its documents."""
    blocks = PackedBlocks(shard, seq_len=seq_len, shuffle=False, document_masking=True)
    return blocks.collate([blocks.sample(0), blocks.sample(1)])


def token_losses(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


def compare(loss, total, token_loss, alone_token_loss, packed_grads, alone_grads, name):
    """The summed losses (relative: fp32 sums of ~50 token losses), each token's loss and every
    gradient, within 1e-5."""
    loss_difference = abs(float(loss.detach() - total.detach())) / abs(float(total.detach()))
    token_difference = float((token_loss - alone_token_loss).abs().max())
    grad_difference = max_difference(packed_grads, alone_grads)
    print(
        f"{name}: summed loss {loss_difference:.3g} (relative), token losses {token_difference:.3g}, "
        f"gradients {grad_difference:.3g}"
    )
    assert loss_difference < 1e-5 and token_difference < 1e-5 and grad_difference < 1e-5


def test_decoder_loss_and_gradients_equal_the_documents_one_by_one(shard):
    batch = packed_and_alone(shard)
    model = tiny()
    output = model(**{k: v for k, v in batch.items() if k != "shift_labels"})
    token_loss = token_losses(output.logits, batch["shift_labels"])
    loss = model(**batch, num_items_in_batch=1).loss  # training: the loss from the hidden states, chunked
    loss.backward()
    packed_grads = grads(model)
    model.zero_grad()
    total, alone = torch.zeros(()), []
    for row in range(batch["input_ids"].shape[0]):
        for start, end in pieces(batch["position_ids"][row].numpy() == 0):
            ids, targets = batch["input_ids"][row : row + 1, start:end], batch["shift_labels"][row : row + 1, start:end]
            total = total + model(input_ids=ids, shift_labels=targets, num_items_in_batch=1).loss  # positions from 0
            with torch.no_grad():
                alone.append(token_losses(model(input_ids=ids).logits, targets))
    total.backward()
    compare(loss, total, token_loss.detach(), torch.cat(alone), packed_grads, grads(model), "decoder")
    # Without the documents the same tokens give another loss: the masking is what made them equal.
    plain = model(batch["input_ids"], shift_labels=batch["shift_labels"], num_items_in_batch=1).loss
    assert abs(float(plain - total)) > 1e-3


def test_encoder_loss_and_gradients_equal_the_documents_one_by_one(shard):
    blocks = MaskedBlocks(
        shard, 24, mask_token_id=2, vocab_size=VOCAB, probability=0.3, shuffle=False, document_masking=True
    )
    batch = blocks.collate([blocks.sample(0), blocks.sample(1)])  # fixed masking: seeded by the sample number
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    model = tiny(LLMStackForMaskedLM, LLMStackEncoderConfig, mask_token_id=2)
    output = model(**{k: v for k, v in batch.items() if k != "labels"})
    token_loss = token_losses(output.logits, batch["labels"].clamp(min=0))
    loss = model(**batch, num_items_in_batch=1).loss
    loss.backward()
    packed_grads = grads(model)
    model.zero_grad()
    total, alone = torch.zeros(()), []
    for row in range(2):
        for start, end in pieces(batch["position_ids"][row].numpy() == 0):
            ids, labels = batch["input_ids"][row : row + 1, start:end], batch["labels"][row : row + 1, start:end]
            if (labels != IGNORE_INDEX).any():
                total = total + model(input_ids=ids, labels=labels, num_items_in_batch=1).loss
            with torch.no_grad():
                alone.append(token_losses(model(input_ids=ids).logits, labels.clamp(min=0)))
    total.backward()
    compare(loss, total, token_loss.detach(), torch.cat(alone), packed_grads, grads(model), "encoder")
    plain = model(batch["input_ids"], labels=batch["labels"], num_items_in_batch=1).loss
    assert abs(float(plain - total)) > 1e-3


def test_moe_routes_each_token_as_in_its_document_alone(shard):
    batch = packed_and_alone(shard)
    model = tiny(num_local_experts=4, num_experts_per_tok=2).eval()
    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    with torch.no_grad():
        packed = model(**inputs).logits
        for row in range(2):
            for start, end in pieces(batch["position_ids"][row].numpy() == 0):
                alone = model(input_ids=batch["input_ids"][row : row + 1, start:end]).logits
                torch.testing.assert_close(packed[row : row + 1, start:end], alone, atol=1e-5, rtol=0)


def test_generation_and_the_plain_path_are_unchanged(shard):
    model = tiny().eval()
    plain = PackedBlocks(shard, seq_len=24, shuffle=False)
    batch = plain.collate([plain.sample(0)])
    assert isinstance(batch, torch.Tensor)  # the option off: the tensor batches of before
    ids = batch[:, :8]
    with torch.no_grad():
        full = model(ids).logits
        one_document = model(ids, position_ids=torch.arange(8)[None], document_ids=torch.zeros_like(ids)).logits
        torch.testing.assert_close(full, one_document, atol=1e-5, rtol=0)
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 11)
    with pytest.raises(ValueError, match="KV-cache"):
        model(ids[:, :1], document_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True, cache=prefilled(model, ids))


def test_without_documents_attention_takes_the_plain_causal_kernel(monkeypatch):
    """The option off calls SDPA exactly as before (no mask, is_causal): the old losses bit for bit."""
    import llmstack.models.modeling_llmstack as modeling

    calls = []
    sdpa = modeling.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(modeling.F, "scaled_dot_product_attention", recording)
    model = tiny()
    ids = torch.randint(0, VOCAB, (2, 8))
    model(ids, shift_labels=ids).loss.backward()
    assert calls and all(mask is None and causal for mask, causal in calls)
    calls.clear()
    model(ids, shift_labels=ids, document_ids=torch.zeros_like(ids), position_ids=torch.arange(8)[None]).loss.backward()
    assert calls and all(mask is not None and not causal for mask, causal in calls)


def prefilled(model, ids):
    return model(ids, use_cache=True).cache


def test_layouts_that_cannot_mask_documents_are_refused(tmp_path, tiny_data):
    from llmstack.parallel.layout import check_layout
    from llmstack.training.config import parse_run_config, run_layout

    for overrides, message in (
        ({"model": {"attention_pattern": "bigbird"}}, "document masking with BigBird"),
        ({"train": {"pipeline_parallel_size": 2}}, "document masking with pipeline"),
    ):
        raw = tiny_run_config(tiny_data, tmp_path)
        raw["data"]["document_masking"] = True
        for section, values in overrides.items():
            raw[section].update(values)
        with pytest.raises(UserError, match=message):
            check_layout(run_layout(parse_run_config(raw), {"zero_optimization": {"stage": 1}}))
    raw = tiny_run_config(tiny_data, tmp_path)
    assert not run_layout(parse_run_config(raw), {}).document_masking  # off unless a config sets it
    raw["data"]["document_masking"] = True
    with pytest.raises(UserError, match="document masking with fine-tuning"):
        check_layout(run_layout(parse_run_config(raw), {}, variable_length=True))


def train_runs(rank, world_size, runs):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    losses = {}
    for name, raw in runs.items():
        trainer = Trainer(parse_run_config(raw), ds_config_path=raw["train"]["ds_config"])
        trainer.train()
        with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
            losses[name] = [json.loads(line) for line in f]
    return losses


def masked_run(tiny_data, out_dir, **train):
    raw = tiny_run_config(
        tiny_data, out_dir, max_steps=2, eval_interval=1, eval_samples=8, ds_config="ds_configs/zero1.json", **train
    )
    raw["data"]["document_masking"] = True
    raw["model"]["num_key_value_heads"] = 2
    return raw


def test_trainer_trains_and_evaluates_with_document_masking_data_and_tensor_parallel(tmp_path, tiny_data):
    """2 ranks: data parallel (ZeRO-1, micro-batch 2) and tensor 2 with sequence parallelism
    (micro-batch 4), the same global batches: the same training and validation losses (1e-5).
    (Data parallelism equals one process: tests/test_layout_matrix.py.)"""
    from llmstack.testing import run_distributed

    runs = {
        "data": masked_run(tiny_data, tmp_path / "data", micro_batch_size=2),
        "tensor": masked_run(tiny_data, tmp_path / "tensor", tensor_parallel_size=2, sequence_parallel=True),
    }
    records = run_distributed(train_runs, 2, args=(runs,))[0]
    for key in ("loss", "val_loss"):
        reference = [r[key] for r in records["data"] if key in r]
        split = [r[key] for r in records["tensor"] if key in r]
        assert len(reference) == len(split) >= 2 and all(np.isfinite(reference))
        difference = float(np.abs(np.array(reference) - np.array(split)).max())
        print(f"tensor 2 + sequence parallel against data 2: {key} {difference:.3g}")
        assert difference < 1e-5


def test_streams_mark_where_each_appended_document_begins(tmp_path, tiny_data):
    from llmstack.data.mlm import MaskedStream, Masking
    from llmstack.data.stream import MixtureStream
    from llmstack.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_data["tokenizer"])
    texts = [" ".join(["fox jumps over the dog"] * (1 + i % 4)) for i in range(12)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    sources = [{"name": "a", "paths": str(tmp_path / "a.jsonl"), "weight": 1.0}]
    stream = MixtureStream(sources, tokenizer, seq_len=16, document_masking=True)
    batch = next(stream.micro_batches(0, 3, 0, 1))
    plain = next(MixtureStream(sources, tokenizer, seq_len=16).micro_batches(0, 3, 0, 1))
    assert torch.equal(batch["input_ids"], plain[:, :-1]) and torch.equal(batch["shift_labels"], plain[:, 1:])
    lengths = [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    offsets = np.cumsum([0, *lengths])
    for row in range(3):
        expected = document_fields(block_starts(offsets, 16 * row, 16)[None])
        assert torch.equal(batch["position_ids"][row], expected["position_ids"][0])
        assert torch.equal(batch["document_ids"][row], expected["document_ids"][0])
    masking = Masking(mask_token_id=2, vocab_size=len(tokenizer), special_ids=(tokenizer.eos_token_id,))
    masked = next(
        MaskedStream(sources, tokenizer, seq_len=16, masking=masking, document_masking=True).micro_batches(0, 3, 0, 1)
    )
    unmasked = next(MaskedStream(sources, tokenizer, seq_len=16, masking=masking).micro_batches(0, 3, 0, 1))
    assert torch.equal(masked["input_ids"], unmasked["input_ids"]) and torch.equal(masked["labels"], unmasked["labels"])
    assert torch.equal(masked["position_ids"], batch["position_ids"])
