"""Token-exact loss: an optimizer step's gradient is that of (summed token loss of the step) / (its
target count), however the step's examples are split into micro-batches and data-parallel ranks.

Fine-tuning examples of very different response lengths (2 to 50 scored tokens, the prompts
masked) go through the Trainer and DeepSpeed (ZeRO stage 0, fp32, so the accumulated, averaged
gradients sit in .grad when the engine steps) as one batch of 8 on 1 rank, micro-batches of 2 x
accumulation 4 on 1 rank, and micro-batches of 2 x accumulation 2 on 2 ranks.
"""

import json

import pytest
import torch
from conftest import tiny_run_config
from inference_fixtures import tiny_model, tiny_tokenizer

from llmstack.models.loss import causal_lm_loss, count_targets, next_token_targets
from llmstack.testing import run_distributed
from llmstack.training.finetune.sft import SFTData

SEQ_LEN = 64
WORDS = "the quick brown fox jumps over the lazy dog and returns the sum of the list".split()
# Responses of 2 to 50 tokens: a mean per micro-batch would weigh their tokens very unequally.
PAIRS = [
    {"prompt": f"Q{i}: {' '.join(WORDS[: 2 + i % 3])}?\nA:", "response": " " + " ".join(WORDS * 3)[:n]}
    for i, n in enumerate((1, 120, 6, 60, 3, 90, 12, 30))
]
LAYOUTS = {  # name: (data-parallel ranks, micro-batch size, accumulation steps), 8 examples a step
    "1x8": (1, 8, 1),
    "2x4": (1, 2, 4),
    "2x2x2": (2, 2, 2),
}
ZERO0 = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_exact")
    tiny_tokenizer(root / "tokenizer")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    (root / "zero0.json").write_text(json.dumps(ZERO0))
    return root


def gradients_at_the_step(engine):
    """{name: gradient} filled when the engine steps at the end of the accumulation."""
    grads, step = {}, engine.step

    def recording_step(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})
        return step(*args, **kwargs)

    engine.step = recording_step
    return grads


def one_step(rank, world_size, raw_by_layout, root, seed=0):
    """(gradients, the loss train_step returns) of one optimizer step per layout."""
    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    results = {}
    for name, raw in raw_by_layout.items():
        data = SFTData(str(root / "pairs.jsonl"), load_tokenizer(str(root / "tokenizer")), SEQ_LEN, seed=0)
        model = tiny_model(seed).train()
        trainer = Trainer(parse_run_config(raw), str(root / "zero0.json"), model=model, train_data=data)
        grads = gradients_at_the_step(trainer.engine)
        loss = trainer.train_step(trainer.train_batches())
        results[name] = ({n: g.numpy() for n, g in grads.items()}, loss)  # arrays travel by value
    return results


def reference(micro_batches, exact=True, seed=0):
    """(gradients, loss) of a plain model over `micro_batches`: token-exact (each micro-batch's summed
    token loss over the target count of them all), or the mean per micro-batch averaged over the
    micro-batches (the normalization this replaces)."""
    model = tiny_model(seed).train()
    total_targets = sum(int(count_targets(next_token_targets(labels=b["labels"]))) for b in micro_batches)
    loss_sum = 0.0
    for batch in micro_batches:
        logits = model(input_ids=batch["input_ids"]).logits
        targets = next_token_targets(labels=batch["labels"])
        loss = causal_lm_loss(logits, targets, num_items_in_batch=total_targets if exact else None)
        (loss if exact else loss / len(micro_batches)).backward()
        loss_sum += loss.item()
    return {n: p.grad for n, p in model.named_parameters()}, loss_sum


def max_difference(a, b):
    return max((torch.as_tensor(a[n]) - torch.as_tensor(b[n])).abs().max().item() for n in a)


def test_gradients_are_equal_for_every_split_of_the_step(tmp_path, sft_files):
    tokenizer_data = {"tokenizer": str(sft_files / "tokenizer"), "train": [], "valid": []}
    raws = {
        name: tiny_run_config(tokenizer_data, tmp_path / name, micro_batch_size=micro, grad_accum_steps=accum)
        for name, (_, micro, accum) in LAYOUTS.items()
    }
    results = {}  # name: (gradients, the mean over ranks of the loss train_step returns)
    for world_size in (1, 2):
        layouts = {name: raws[name] for name, (ranks, _, _) in LAYOUTS.items() if ranks == world_size}
        per_rank = run_distributed(one_step, world_size, args=(layouts, sft_files))
        for name in layouts:
            results[name] = (per_rank[0][name][0], sum(r[name][1] for r in per_rank) / world_size)

    data = SFTData(str(sft_files / "pairs.jsonl"), tiny_tokenizer(tmp_path / "tok"), SEQ_LEN, seed=0)
    batch = next(data.micro_batches(0, 8, 0, 1))
    targets = [int(count_targets(next_token_targets(labels=row[None]))) for row in batch["labels"]]
    assert min(targets) <= 3 and max(targets) >= 30, targets  # the data really are of unequal lengths
    micro_batches = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    exact_grads, exact_loss = reference([batch])

    for name, (grads, loss) in results.items():
        # Measured with model seeds 0, 1, 2: max |gradient difference| 1.8e-7, 1.9e-7, 2.1e-7 (0 for
        # 1x8); the loss (about 7) differed by at most 7.2e-7 (float32 sums in other orders).
        assert max_difference(grads, exact_grads) < 1e-6, name
        assert loss == pytest.approx(exact_loss, rel=1e-6), name  # the step's loss per target token
    # The same split into micro-batches: equal when token-exact, far off with a mean per micro-batch
    # (so the test tells the two apart).
    assert max_difference(reference(micro_batches)[0], exact_grads) < 1e-6
    assert max_difference(reference(micro_batches, exact=False)[0], exact_grads) > 1e-3


def _vocab_parallel_against_whole_logits(rank, world_size):
    """Max |difference| of loss and logit gradients: vocab_parallel_cross_entropy on this rank's
    shard against causal_lm_loss on the whole logits, both with one normalizer for the batch."""
    import torch.distributed as dist

    from llmstack.parallel import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)  # 11 = 6 + 5 columns: an uneven split
    targets = torch.randint(0, 11, (3, 5))
    targets[0, :3] = -100
    whole = logits.clone().requires_grad_()
    shard = logits[..., :6] if rank == 0 else logits[..., 6:]
    shard = shard.clone().requires_grad_()
    kwargs = {"label_smoothing": 0.1, "z_loss": 1e-3, "num_items_in_batch": 37.0}  # not the 12 targets here
    expected = causal_lm_loss(whole, targets, **kwargs)
    actual = vocab_parallel_cross_entropy(shard, targets, group=dist.group.WORLD, vocab_size=11, **kwargs)
    expected.backward()
    actual.backward()
    grad = whole.grad[..., :6] if rank == 0 else whole.grad[..., 6:]
    return abs(actual.item() - expected.item()), (shard.grad - grad).abs().max().item()


def test_vocab_parallel_loss_takes_the_same_normalizer_with_smoothing_and_z_loss():
    for loss_diff, grad_diff in run_distributed(_vocab_parallel_against_whole_logits, 2):
        # Measured: loss 1.2e-7 (one float32 step of the ~1.0 loss), gradients 4e-9, on both ranks.
        assert loss_diff < 1e-6 and grad_diff < 1e-6, (loss_diff, grad_diff)


def test_the_loss_is_the_summed_token_loss_over_the_normalizer():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    targets[1] = -100
    summed = causal_lm_loss(logits, targets, num_items_in_batch=1)
    assert causal_lm_loss(logits, targets) == pytest.approx(summed.item() / 4, rel=1e-6)  # 4 scored targets
    assert causal_lm_loss(logits, targets, num_items_in_batch=10) == pytest.approx(summed.item() / 10, rel=1e-6)
