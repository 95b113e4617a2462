"""Context parallelism (train.context_parallel_size): a sequence split over 2 ranks computes the
loss and gradients of one process, by Ulysses (all-to-all over heads) and by ring attention, with
and without document masking (documents crossing the load-balanced chunks' edges), at 4096 tokens.

Measured (fp32, tiny model: hidden 32, 2 layers, 4 heads sharing 2 key/value heads, one sample of
4096 tokens), largest difference from one process over seeds 0-3, loss (about 4.85, whose fp32
spacing is 4.8e-7) / any gradient element:
    ulysses             4.8e-7 / 2.1e-9
    ulysses, documents  4.8e-7 / 2.3e-9
    ring                4.8e-7 / 2.3e-9
    ring, documents     9.5e-7 / 2.8e-9
hence the 1e-5 bound. Each seed: loss and gradients equal on 0 to 2 of the 4 cases.

Tensor 2 x context 2 on 4 ranks (3 trainer steps of 256 tokens, document masking, ZeRO-2), largest
difference from one process over train.seed 1234, 0 and 1, training loss / validation loss / any
final weight: Ulysses 9.5e-7 / 1.2e-7 / 2.0e-6, ring 9.5e-7 / 2.4e-7 / 1.9e-6 (both at seed 0; at
the other seeds at most 4.8e-7 / 2.4e-7 / 4.3e-7), within the same 1e-5 bound.
"""

import copy

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL

from llmstack.data.documents import document_fields
from llmstack.parallel.context_parallel import chunk_indices
from llmstack.testing import run_distributed

SEQ = 4096
METHODS = ("ulysses", "ring")
TOLERANCE = 1e-5
# Document starts: every chunk edge of 2 ranks (1024, 2048, 3072) lies inside a document.
DOCUMENT_STARTS = (0, 700, 1500, 2600, 3000, 3900)


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([chunk_indices(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="2 x 2 equal chunks"):
        chunk_indices(10, 2, 0)


def batch(seed, document_masking):
    """One packed sample of SEQ inputs and shifted targets (some targets ignored), with its
    documents when `document_masking`."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (1, SEQ + 1), generator=generator)
    inputs = {"input_ids": tokens[:, :-1], "shift_labels": tokens[:, 1:].clone()}
    inputs["shift_labels"][:, 100:164] = -100
    if document_masking:
        starts = np.zeros((1, SEQ), dtype=bool)
        starts[:, list(DOCUMENT_STARTS)] = True
        inputs.update(document_fields(starts))
    return inputs


def differences(rank, world_size, seeds):
    """{(method, document masking): (largest loss difference, largest gradient difference)} over
    `seeds`, between one process's loss and gradients and the context-parallel ranks' summed."""
    import torch.distributed as dist

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.models.loss import count_targets
    from llmstack.parallel.context_parallel import context_parallelize, shard_sequence

    found: dict = {}
    for seed in seeds:
        torch.manual_seed(seed)
        reference = LLMStackForCausalLM(LLMStackConfig(vocab_size=128, num_key_value_heads=2, **TINY_MODEL))
        for document_masking in (False, True):
            inputs = batch(seed, document_masking)
            targets = count_targets(inputs["shift_labels"])
            reference.zero_grad(set_to_none=True)
            loss = reference(**inputs, num_items_in_batch=targets).loss
            loss.backward()
            for method in METHODS:
                model = context_parallelize(copy.deepcopy(reference), None, method)
                model.zero_grad(set_to_none=True)
                shard_loss = model(**shard_sequence(inputs, None), num_items_in_batch=targets).loss
                shard_loss.backward()
                total = shard_loss.detach().clone()
                dist.all_reduce(total)
                grad = 0.0
                for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
                    dist.all_reduce(p.grad)
                    grad = max(grad, (p.grad - ref.grad).abs().max().item())
                key = (method, document_masking)
                previous = found.get(key, (0.0, 0.0))
                found[key] = (max(previous[0], abs(total.item() - loss.item())), max(previous[1], grad))
    return found


@pytest.fixture(scope="module")
def measured():
    return run_distributed(differences, 2, args=((0,),))[0]


@pytest.mark.parametrize("document_masking", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("method", METHODS)
def test_loss_and_gradients_equal_one_process(measured, method, document_masking):
    loss, grad = measured[(method, document_masking)]
    assert loss < TOLERANCE and grad < TOLERANCE, (loss, grad)


def core_differences(rank, world_size):
    """Largest difference of each attention core's output and q/k/v gradients from SDPA's over
    the whole sequence, in float64, for 2 samples with different documents."""
    import torch.nn.functional as F

    from llmstack.models.modeling_llmstack import document_mask
    from llmstack.parallel.context_parallel import RingAttention, SequenceShare, UlyssesAttention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 6, 96, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    documents = torch.tensor([[0] * 10 + [1] * 30 + [2] * 20 + [3] * 36, [0] * 50 + [1] * 46])
    index = chunk_indices(96, world_size, rank)
    found = {}
    for docs in (None, documents):
        mask = None if docs is None else document_mask(docs)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=docs is None)
        grad = torch.randn_like(expected)
        whole = torch.autograd.grad(expected, (q, k, v), grad)
        share = SequenceShare(None)
        share.gather_documents(None if docs is None else docs[:, index])
        for core in (UlyssesAttention(share), RingAttention(share)):
            mine = [t.detach()[:, :, index].requires_grad_(True) for t in (q, k, v)]
            out = core(*mine, is_causal=True)
            grads = torch.autograd.grad(out, mine, grad[:, :, index])
            pairs = [(out, expected), *zip(grads, whole)]
            found[(type(core).__name__, docs is not None)] = max(
                (a - b[:, :, index]).abs().max().item() for a, b in pairs
            )
    return found


def test_attention_cores_on_three_ranks():
    """Both cores on 3 ranks (6 chunks, 3 ring steps) in float64: SDPA's output and gradients."""
    for found in run_distributed(core_differences, 3):
        assert max(found.values()) < 1e-12, found


def train_runs(rank, world_size, runs):
    """{name: (training losses, validation loss, layout, final weights)} of each (run config,
    ds_config path); the weights (the plain model's full state dict) on rank 0 only."""
    import json

    from llmstack.parallel.checkpoint import gather_full_state_dict
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    found = {}
    for name, (raw, ds_config_path) in runs.items():
        trainer = Trainer(parse_run_config(raw), ds_config_path=ds_config_path)
        trainer.train()
        with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        losses = [r["loss"] for r in records if "loss" in r]
        val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
        weights = gather_full_state_dict(trainer.engine.module, trainer.topology)
        found[name] = (losses, val_loss, trainer.layout.describe(), weights)
    return found


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, tiny_data):
    """run(name, out_dir=name, **train): (name, (run config, ds_config path)) of 3 steps of 2 samples of 256
    tokens with document masking, ZeRO-2, then a validation pass; and one process's results."""
    import json

    from conftest import tiny_run_config

    base = tmp_path_factory.mktemp("context_trainer")
    ds_path = base / "zero2.json"
    ds_path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))

    def run(name, out_dir=None, **train):
        out = base / (out_dir or name)
        raw = tiny_run_config(tiny_data, out, max_steps=3, micro_batch_size=2, eval_interval=3, **train)
        raw["data"].update(seq_len=256, document_masking=True)
        raw["train"]["eval_samples"] = 4
        return name, (raw, str(ds_path))

    one = run_distributed(train_runs, 1, args=(dict([run("one")]),))[0]["one"]
    return run, one


def assert_trains_as_one_process(found, one, layout_words, weights_tolerance=None):
    for name, (losses, val_loss, layout, weights) in found.items():
        assert layout_words.format(name) in layout, layout
        assert len(losses) == 3
        assert max(abs(a - b) for a, b in zip(losses, one[0])) < TOLERANCE, (name, losses, one[0])
        assert abs(val_loss - one[1]) < TOLERANCE, (name, val_loss, one[1])
        if weights_tolerance is not None:
            assert weights.keys() == one[3].keys()
            largest = max((weights[k] - one[3][k]).abs().max().item() for k in weights)
            assert largest < weights_tolerance, (name, largest)


def test_trainer_with_context_parallelism_trains_as_one_process(trainer_run):
    """A context-parallel pair (Ulysses; ring with activation checkpointing) logs one process's losses."""
    run, one = trainer_run
    ring = run("ring", context_parallel_size=2, context_parallel_method="ring", activation_checkpointing=True)
    two = run_distributed(train_runs, 2, args=(dict([run("ulysses", context_parallel_size=2), ring]),))[0]
    assert_trains_as_one_process(two, one, "context 2 ({})")


def test_tensor_and_context_parallelism_train_as_one_process(trainer_run):
    """Tensor 2 x context 2 on 4 ranks (Ulysses: 2 heads per tensor-parallel rank, one per context
    rank; ring): one process's losses, validation loss and final weights."""
    run, one = trainer_run
    sizes = {"tensor_parallel_size": 2, "context_parallel_size": 2}
    ulysses = run("ulysses", "tensor_ulysses", **sizes)
    runs = dict([ulysses, run("ring", "tensor_ring", context_parallel_method="ring", **sizes)])
    four = run_distributed(train_runs, 4, args=(runs,))[0]
    assert_trains_as_one_process(four, one, "tensor 2 x context 2 ({})", weights_tolerance=TOLERANCE)


def test_context_parallel_settings_are_checked_before_start_up(tmp_path, tiny_data):
    from conftest import tiny_run_config

    from llmstack.errors import UserError
    from llmstack.models import LLMStackConfig
    from llmstack.parallel.context_parallel import check_context_parallel_size
    from llmstack.parallel.layout import Layout, check_layout
    from llmstack.training.config import parse_run_config

    raw = tiny_run_config(tiny_data, tmp_path, context_parallel_size=3)
    with pytest.raises(UserError, match="multiple of 2 x train.context_parallel_size"):
        parse_run_config(raw)  # 32 tokens do not cut into 6 chunks
    raw = tiny_run_config(tiny_data, tmp_path, context_parallel_size=2, tensor_parallel_size=4)
    with pytest.raises(UserError, match=r"must divide the attention heads per tensor-parallel rank \(1\)"):
        parse_run_config(raw)  # 4 heads over 4 tensor ranks: one each, not split over 2 context ranks
    raw["train"]["context_parallel_method"] = "ring"
    parse_run_config(raw)
    with pytest.raises(UserError, match="context parallelism with pipeline parallelism"):
        check_layout(Layout(context=2, pipeline=2))
    with pytest.raises(UserError, match="context_parallel_method must be one of ulysses, ring"):
        Layout(context=2, context_method="zigzag")
    with pytest.raises(UserError, match="set train.context_parallel_method ring"):
        check_context_parallel_size(LLMStackConfig(vocab_size=128, **TINY_MODEL), 3, "ulysses")
    check_context_parallel_size(LLMStackConfig(vocab_size=128, **TINY_MODEL), 3, "ring")  # any head count
