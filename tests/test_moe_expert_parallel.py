"""Expert parallelism on 2 gloo ranks: a model whose experts are split over an expert-parallel
group of 2 trains exactly as the same model with every expert on every rank (expert-parallel 1,
plain data parallelism), its all-to-all bytes are the analytic count, and its gathered experts
export to one Mixtral model.

The training loop here is plain PyTorch: dense gradients are averaged over the data-parallel
group; expert gradients, which already hold their expert-parallel group's tokens, are divided by
the data-parallel size and summed over the expert-data-parallel group (what DeepSpeed does for
parameters marked allreduce=False; tests/test_moe_ep_training.py trains through DeepSpeed)."""

import torch
import torch.distributed as dist

from llmstack.models import LLMStackConfig, LLMStackForCausalLM, to_hf
from llmstack.parallel import CommStats, Topology
from llmstack.parallel.expert_parallel import (
    all_to_all_bytes,
    expert_parallelize,
    gather_expert_state_dict,
    is_expert_parameter,
    moe_blocks,
)
from llmstack.testing import run_distributed

CONFIG = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    router_z_loss_coef=0.001,
)
STEPS, BATCH, SEQ = 5, 2, 12
TOLERANCE = 1e-5  # the Done-when bound (fp32); measured: losses differ by <= 1e-6 over 5 steps


def reduce_gradients(model, topology):
    dp = topology.data_parallel_size
    for param in model.parameters():
        if is_expert_parameter(param):
            param.grad /= dp
            dist.all_reduce(param.grad, group=topology.expert_data_parallel_group)
        else:
            dist.all_reduce(param.grad, group=topology.data_parallel_group)
            param.grad /= dp


def routed_rows(model, topology, tokens, router_stats):
    """(rows this rank sends, rows its experts receive) per MoE block, from the routing statistics."""
    k, ep = model.config.num_experts_per_tok, topology.expert_parallel_size
    rows = []
    for block, stats in zip(moe_blocks(model), router_stats):
        counts = (stats.load * tokens * k).round()
        total = counts.clone()
        dist.all_reduce(total, group=topology.expert_parallel_group)
        local = block.num_experts // ep
        mine = dist.get_rank(topology.expert_parallel_group)
        rows.append((int(counts.sum()), int(total[mine * local : (mine + 1) * local].sum())))
    return rows


def train(rank, world_size, expert_parallel_size):
    torch.manual_seed(0)
    topology = Topology(expert_parallel_size=expert_parallel_size)
    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
    if expert_parallel_size > 1:
        expert_parallelize(model, topology.expert_parallel_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses, comm = [], None
    for step in range(STEPS):
        batches = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=data) for _ in range(world_size)]
        ids = batches[rank]
        stats = CommStats()
        with stats:
            output = model(ids, labels=ids)
            loss = output.loss
            loss.backward()
        if step == 0 and expert_parallel_size > 1:
            expected = sum(
                all_to_all_bytes(CONFIG["num_local_experts"], sent, received, CONFIG["hidden_size"], 4)
                for sent, received in routed_rows(model, topology, BATCH * SEQ, output.router_stats)
            )
            comm = (stats.bytes["all_to_all"], expected)
        reduce_gradients(model, topology)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if expert_parallel_size > 1:
        return losses, comm, gather_expert_state_dict(model, topology.expert_parallel_group)
    return losses, comm, model.state_dict()


def train_both(rank, world_size):
    """Expert-parallel 1, then 2, in the same processes (one start-up)."""
    return train(rank, world_size, 1), train(rank, world_size, 2)


def test_expert_parallel_2_trains_as_expert_parallel_1_and_exports_to_one_mixtral():
    ranks = run_distributed(train_both, 2)
    for (losses, _, _), (ep_losses, comm, _) in ranks:
        assert max(abs(a - b) for a, b in zip(losses, ep_losses)) <= TOLERANCE
        measured, expected = comm
        assert measured == expected > 0
    (_, _, replicated_state), (_, _, gathered_state) = ranks[0]
    replicated, gathered = (LLMStackForCausalLM(LLMStackConfig(**CONFIG)).eval() for _ in range(2))
    replicated.load_state_dict(replicated_state)
    gathered.load_state_dict(gathered_state)  # every expert, from both ranks
    ids = torch.randint(0, CONFIG["vocab_size"], (2, SEQ))
    with torch.no_grad():
        assert (to_hf(gathered, "mixtral").eval()(ids).logits - replicated(ids).logits).abs().max() <= TOLERANCE
