import pytest
import torch

from llmstack.inference.sampling import SamplingParams, apply_repetition_penalty, next_token

DRAWS = 20000


def spread_logits(vocab=50, seed=0):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def draw(logits, params, seed=0):
    """DRAWS independent samples from one row of logits, in one batched call."""
    rows = logits.expand(DRAWS, -1)
    return next_token(rows, params, generator=torch.Generator().manual_seed(seed))


def test_top_k_draws_only_the_k_most_likely_tokens():
    logits = spread_logits()
    allowed = set(torch.topk(logits, 5).indices.tolist())
    drawn = set(draw(logits, SamplingParams(temperature=1.5, top_k=5)).tolist())
    assert drawn == allowed  # nothing outside, and all five reachable


def test_top_p_draws_only_from_the_smallest_set_reaching_p():
    logits = spread_logits(seed=1)
    probs, order = logits.softmax(-1).sort(descending=True)
    for p in (0.3, 0.75, 0.9):
        size = int((probs.cumsum(-1) < p).sum()) + 1  # smallest prefix whose mass reaches p
        allowed = set(order[:size].tolist())
        drawn = set(draw(logits, SamplingParams(top_p=p)).tolist())
        assert drawn <= allowed and len(drawn) >= min(size, 2)


def test_top_k_and_top_p_together_respect_both():
    logits = spread_logits(seed=2)
    top10 = torch.topk(logits, 10).indices
    probs = logits[top10].softmax(-1)  # top-p applies to what top-k left
    size = int((probs.cumsum(-1) < 0.8).sum()) + 1
    drawn = set(draw(logits, SamplingParams(top_k=10, top_p=0.8)).tolist())
    assert drawn <= set(top10[:size].tolist())


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    counts = torch.bincount(draw(logits, SamplingParams(temperature=2.0)), minlength=4).float()
    expected = (logits / 2.0).softmax(-1)
    assert torch.allclose(counts / DRAWS, expected, atol=0.015)


def test_same_seed_same_draws_and_greedy_is_argmax():
    logits = spread_logits(seed=3)
    params = SamplingParams(top_k=20)
    assert torch.equal(draw(logits, params, seed=7), draw(logits, params, seed=7))
    assert not torch.equal(draw(logits, params, seed=7), draw(logits, params, seed=8))
    assert next_token(logits[None], SamplingParams(temperature=0)).item() == logits.argmax().item()


def test_repetition_penalty_shrinks_seen_logits_toward_unlikely():
    logits = torch.tensor([[3.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.5, -4.0, 1.0, 0.5]]
    # Seen token 0 was the argmax; with the penalty greedy picks the best unseen token.
    assert next_token(logits, SamplingParams(temperature=0, repetition_penalty=4.0), seen).item() == 2


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(repetition_penalty=0)])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
