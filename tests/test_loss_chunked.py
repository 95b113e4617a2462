"""linear_cross_entropy (the training loss, computed a chunk of tokens at a time without whole
logits) against causal_lm_loss on the whole logits: same loss and gradients with label smoothing,
z-loss, focal loss and a token-exact normalizer. The vocabulary-parallel versions are checked the
same way on 2 ranks in tests/test_parallel_tensor.py (its one launch)."""

import pytest
import torch

import llmstack.models.loss as loss_module
from llmstack.models.loss import (
    CHUNK_LOGITS,
    IGNORE_INDEX,
    causal_lm_loss,
    chunk_tokens,
    linear_cross_entropy,
    tallying_predictions,
)

OPTIONS = [  # without focal weighting the chunks take the closed-form gradient, with it autograd
    {},
    {"label_smoothing": 0.2},
    {"z_loss": 1e-2, "num_items_in_batch": 5.0},
    {"label_smoothing": 0.1, "z_loss": 1e-3, "num_items_in_batch": 37.0},
    {"label_smoothing": 0.1, "focal_gamma": 2.0},
    {"focal_gamma": 0.5, "z_loss": 1e-2},
]


def _inputs(vocab: int, tokens: int = 29, width: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    hidden, weight = torch.randn(tokens, width), torch.randn(vocab, width)
    targets = torch.randint(0, vocab, (tokens,))
    targets[::4] = IGNORE_INDEX
    return hidden, weight, targets


def _loss_and_grads(loss_fn, hidden, weight, *args, **kwargs) -> list[torch.Tensor]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, *args, **kwargs)
    (3.0 * loss).backward()  # an upstream gradient other than 1 (as a loss scale is)
    return [loss.detach(), hidden.grad, weight.grad]


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _whole_logits_loss(hidden, weight, targets, **options):
    return causal_lm_loss(hidden @ weight.t(), targets, **options)


@pytest.mark.parametrize("options", OPTIONS)
def test_chunked_loss_and_gradients_equal_the_whole_logits_loss(monkeypatch, options):
    hidden, weight, targets = _inputs(vocab=23)
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 23 * 5)  # 5 tokens a chunk: 6 chunks, the last short
    expected = _loss_and_grads(_whole_logits_loss, hidden, weight, targets, **options)
    actual = _loss_and_grads(linear_cross_entropy, hidden, weight, targets, **options)
    assert _max_difference(actual, expected) < 1e-5


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_fn", [linear_cross_entropy, _whole_logits_loss])
def test_losses_tally_the_targets_their_logits_predict(monkeypatch, options, loss_fn):
    """Accuracy counted inside the losses (closed-form chunks, autograd chunks, whole logits) equals
    the argmax of the logits over the scored targets; outside a tally nothing is counted."""
    hidden, weight, targets = _inputs(vocab=23, tokens=200)
    targets[1::3] = (hidden @ weight.t()).argmax(-1)[1::3]  # some predicted, some not
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 23 * 7)
    scored = targets != IGNORE_INDEX
    expected = ((hidden @ weight.t()).argmax(-1) == targets)[scored].sum().item()
    with tallying_predictions() as tally:
        loss_fn(hidden, weight, targets, **options)
        loss_fn(hidden, weight, targets, **options)  # counts add up
    assert tally.counts() == (2 * expected, 2 * scored.sum().item())
    assert 0 < expected < scored.sum().item()


def test_a_chunk_of_logits_grows_with_the_input_between_a_floor_and_a_cap():
    """At long sequence a chunk holds no more logits than the input holds hidden values, so the
    loss's memory scales with a rank's tokens (context parallelism halves it); short inputs keep
    chunks of 256 tokens, and no chunk exceeds CHUNK_LOGITS."""
    assert chunk_tokens(8192, 256, 8192) == 256  # 2^21 logits = the input's 8192 x 256 values
    assert chunk_tokens(32768, 256, 8192) == 1024
    assert chunk_tokens(100, 256, 8192) == 256  # the floor
    assert chunk_tokens(1 << 20, 4096, 128256) * 128256 <= CHUNK_LOGITS  # the cap: Llama 3's vocabulary
    assert chunk_tokens(1 << 20, 4096, 128256) == CHUNK_LOGITS // 128256


def test_chunked_loss_needs_no_gradients_under_no_grad():
    hidden, weight, targets = _inputs(vocab=23)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(loss, causal_lm_loss(hidden @ weight.t(), targets))


def _zero_losses(rank, world_size):
    """Losses of 3 steps at ZeRO-0 and ZeRO-3 through llmstack's `initialize`, and the stages whose
    training steps called lm_head: none, as the chunked loss reads its weight, which ZeRO-3
    gathers on access inside the engine's forward."""
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.optim.deepspeed_integration import initialize

    losses, head_calls = {}, []
    for stage in (0, 3):
        torch.manual_seed(0)
        config = LLMStackConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            tie_word_embeddings=False,
        )
        model = LLMStackForCausalLM(config)
        model.lm_head.register_forward_hook(lambda *_, stage=stage: head_calls.append(stage))
        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        }
        engine, *_ = initialize(model, ds_config, model.parameters())
        generator = torch.Generator().manual_seed(rank)
        losses[stage] = []
        for _ in range(3):
            tokens = torch.randint(0, 96, (2, 17), generator=generator)
            loss = engine(input_ids=tokens[:, :-1], shift_labels=tokens[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses[stage].append(loss.item())
    return losses, head_calls


def test_zero3_training_takes_the_chunked_loss_with_the_same_losses():
    from llmstack.testing import run_distributed

    for losses, head_calls in run_distributed(_zero_losses, world_size=2):
        assert head_calls == []
        assert losses[3] == pytest.approx(losses[0], abs=1e-5)
