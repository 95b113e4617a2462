"""Tensor parallelism of a mixture-of-experts model on 4 gloo ranks (data parallel 2 x tensor
parallel 2): each tensor-parallel rank holds whole experts (and its columns of the shared expert);
with expert parallelism 2 as well, each rank holds a quarter of the experts. Both train as the
same model replicated on every rank, and gather into one model that computes as they do.

The loop is plain PyTorch, with the data-parallel gradient reduction of
tests/test_moe_expert_parallel.py; tests/test_moe_ep_training.py trains through DeepSpeed."""

import re

import pytest
import torch
from test_moe_expert_parallel import CONFIG as EP_CONFIG
from test_moe_expert_parallel import reduce_gradients

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.parallel import Topology, gather_full_state_dict, parallelize
from llmstack.parallel.expert_parallel import expert_parallelize
from llmstack.parallel.tensor_parallel import check_moe_tensor_parallel
from llmstack.testing import run_distributed

CONFIG = {**EP_CONFIG, "moe_shared_intermediate_size": 8}
STEPS, BATCH, SEQ = 5, 2, 12
# The bound for parallel layouts (fp32). Measured over seeds 0-3: losses differ from the
# replicated model's by <= 9.5e-7 over 5 steps; the gathered model's held-out loss from the
# parallel model's by <= 4.8e-7 (one float32 ulp of the loss).
TOLERANCE = 1e-5
HELD_OUT = torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(2))


def train(rank, world_size, tensor_parallel_size, expert_parallel_size):
    torch.manual_seed(0)
    topology = Topology(tensor_parallel_size=2, expert_parallel_size=expert_parallel_size)
    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
    if tensor_parallel_size > 1:
        parallelize(model, topology)
    if expert_parallel_size > 1:
        expert_parallelize(model, topology.expert_parallel_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        batches = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=data) for _ in range(2)]
        ids = batches[topology.data_parallel_rank]
        loss = model(ids, labels=ids).loss
        loss.backward()
        reduce_gradients(model, topology)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        held_out = model.eval()(HELD_OUT, labels=HELD_OUT).loss.item()
    return losses, held_out, gather_full_state_dict(model, topology) if tensor_parallel_size > 1 else None


def train_all(rank, world_size):
    """Replicated (the tensor-parallel ranks compute the whole model alike), tensor-parallel 2,
    and tensor-parallel 2 x expert-parallel 2, in the same processes."""
    return [train(rank, world_size, tp, ep) for tp, ep in ((1, 1), (2, 1), (2, 2))]


def test_tensor_parallel_moe_trains_as_the_replicated_model_and_gathers_to_its_weights():
    ranks = run_distributed(train_all, 4)
    for (reference, *_), *layouts in ranks:
        for losses, *_ in layouts:
            assert max(abs(a - b) for a, b in zip(reference, losses)) <= TOLERANCE
    for _, held_out, state in ranks[0][1:]:  # every expert, from every rank
        gathered = LLMStackForCausalLM(LLMStackConfig(**CONFIG)).eval()
        gathered.load_state_dict(state)
        with torch.no_grad():
            assert abs(gathered(HELD_OUT, labels=HELD_OUT).loss.item() - held_out) <= TOLERANCE


@pytest.mark.parametrize(
    "experts, tp, ep, needed",
    [(2, 4, 1, "at least train.tensor_parallel_size (4)"), (6, 2, 2, "a multiple of train.tensor_parallel_size")],
)
def test_tensor_parallel_needs_whole_experts_on_every_rank(experts, tp, ep, needed):
    with pytest.raises(UserError, match=re.escape(needed)):
        check_moe_tensor_parallel(LLMStackConfig(**{**CONFIG, "num_local_experts": experts}), tp, ep)
