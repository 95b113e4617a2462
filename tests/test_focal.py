"""Focal loss (model.focal_gamma): each token's loss weighted by (1 - p_target)^gamma, with label
smoothing applied inside the weighted term. The tensor-parallel (TP 2 vs 1) comparison is one of the
variants of tests/test_parallel_tensor.py; the vocabulary-parallel function is checked with focal
options in tests/test_loss_chunked.py."""

import math

import pytest
import torch

from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.loss import IGNORE_INDEX, causal_lm_loss

LOGITS = [[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]]
TARGETS = [0, 1]


def _by_hand(gamma: float, smoothing: float) -> float:
    """The mean focal loss of LOGITS / TARGETS, written out with math (no torch)."""
    total = 0.0
    for row, target in zip(LOGITS, TARGETS, strict=True):
        log_z = math.log(sum(math.exp(x) for x in row))
        log_p = [x - log_z for x in row]
        cross_entropy = (1 - smoothing) * -log_p[target] + smoothing * -sum(log_p) / len(row)
        total += (1 - math.exp(log_p[target])) ** gamma * cross_entropy
    return total / len(TARGETS)


@pytest.mark.parametrize(("gamma", "smoothing"), [(0.0, 0.0), (2.0, 0.0), (2.0, 0.1), (0.5, 0.2)])
def test_focal_loss_equals_the_hand_computation(gamma, smoothing):
    loss = causal_lm_loss(torch.tensor(LOGITS), torch.tensor(TARGETS), smoothing, focal_gamma=gamma)
    assert loss.item() == pytest.approx(_by_hand(gamma, smoothing), rel=1e-6)


def test_focal_gamma_0_is_cross_entropy_and_a_larger_gamma_weighs_easy_tokens_less():
    logits, targets = torch.tensor(LOGITS), torch.tensor(TARGETS)
    plain = torch.nn.functional.cross_entropy(logits, targets)
    assert causal_lm_loss(logits, targets, focal_gamma=0.0) == pytest.approx(plain.item(), rel=1e-6)
    assert causal_lm_loss(logits, targets, focal_gamma=1.0) < plain
    assert causal_lm_loss(logits, targets, focal_gamma=2.0) < causal_lm_loss(logits, targets, focal_gamma=1.0)


def test_model_focal_gamma_gives_the_same_loss_in_training_and_evaluation():
    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        focal_gamma=2.0,
        label_smoothing=0.1,
    )
    model = LLMStackForCausalLM(config)
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    trained = model.train()(ids, labels=labels).loss  # chunked, from the hidden states
    evaluated = model.eval()(ids, labels=labels)  # from the logits
    expected = causal_lm_loss(evaluated.logits[:, :-1], labels[:, 1:], 0.1, focal_gamma=2.0)
    torch.testing.assert_close(evaluated.loss, expected)
    torch.testing.assert_close(trained, evaluated.loss)
    assert LLMStackConfig.from_dict(config.to_dict()).focal_gamma == 2.0
