"""BurstAdamW: plain AdamW on dense gradients, n steps' worth of movement from a burst of n steps."""

import copy

import pytest
import torch

from llmstack.optim import BurstAdamW

SETTINGS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def two_groups(weights):
    """Parameters in two groups with their own weight decay, as the trainer builds them."""
    a, b = (torch.nn.Parameter(w.clone()) for w in weights)
    return [a, b], [{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}]


def gradients(steps, zero_share=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(300, generator=g), torch.randn(40, generator=g)]
        yield [x * (torch.rand(x.shape, generator=g) >= zero_share) for x in grads]


def run(optimizer, params, grads):
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        optimizer.step()


@pytest.mark.parametrize("zero_share, dense_steps", [(0.0, 0), (0.5, 20)])
def test_dense_steps_are_torch_adamw_bit_for_bit(zero_share, dense_steps):
    """Nonzero gradients everywhere, or any gradients within dense_steps: torch's AdamW exactly."""
    weights = [torch.randn(300), torch.randn(40)]
    ours, ours_groups = two_groups(weights)
    theirs, theirs_groups = two_groups(weights)
    run(BurstAdamW(ours_groups, dense_steps=dense_steps, **SETTINGS), ours, gradients(20, zero_share))
    run(torch.optim.AdamW(theirs_groups, foreach=False, **SETTINGS), theirs, gradients(20, zero_share))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def distance_moved(optimizer_class, every):
    """How far a weight moves in 500 steps whose gradient 1.0 arrives as `every` x 1.0 every
    `every` steps, as a fraction of how far it moves when the gradient arrives every step."""
    moved = []
    for n in (1, every):
        p = torch.nn.Parameter(torch.zeros(1))
        optimizer = optimizer_class([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        for step in range(1, 501):
            p.grad = torch.full((1,), float(n) if step % n == 0 else 0.0)
            optimizer.step()
        moved.append(-p.item())
    return moved[1] / moved[0]


@pytest.mark.parametrize("every", [10, 50])
def test_a_burst_of_n_steps_moves_the_weight_about_n_steps_worth(every):
    # Deterministic (no randomness): BurstAdamW 0.97 at 10, 0.71 at 50; AdamW 0.31 and 0.10.
    assert distance_moved(BurstAdamW, every) > 0.65
    assert distance_moved(torch.optim.AdamW, every) < 0.4


def test_resume_from_state_dict_continues_exactly_and_a_state_without_gaps_loads():
    weights = [torch.randn(300), torch.randn(40)]
    params, groups = two_groups(weights)
    optimizer = BurstAdamW(groups, **SETTINGS)
    grads = list(gradients(12, zero_share=0.9))
    run(optimizer, params, grads[:6])
    saved_weights, saved_state = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
    run(optimizer, params, grads[6:])

    resumed, resumed_groups = two_groups(saved_weights)
    again = BurstAdamW(resumed_groups, **SETTINGS)
    again.load_state_dict(saved_state)
    run(again, resumed, grads[6:])
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))

    for state in saved_state["state"].values():  # as after a universal checkpoint: Adam's moments only
        del state["gap"]
    restarted, restarted_groups = two_groups(saved_weights)
    without_gaps = BurstAdamW(restarted_groups, **SETTINGS)
    without_gaps.load_state_dict(saved_state)
    run(without_gaps, restarted, grads[6:])
    assert all(torch.isfinite(p).all() for p in restarted)
    assert not torch.equal(params[0], restarted[0])  # the gaps restart from zero


def test_rejects_settings_adamw_rejects():
    p = [torch.nn.Parameter(torch.zeros(1))]
    for bad in (dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(dense_steps=-1)):
        with pytest.raises(ValueError):
            BurstAdamW(p, **bad)
