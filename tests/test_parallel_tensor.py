"""Tensor parallelism on 2 gloo ranks, against the unsplit model on the same weights.

All checks run in one launch (a module fixture); each test asserts on what the ranks returned.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from llmstack.testing import run_distributed

TOL = 1e-5
# Vocabulary 251 and MLP width 91 do not divide by 2: they are split unevenly, with no padding.
UNEVEN = {
    "vocab_size": 251,
    "hidden_size": 64,
    "intermediate_size": 91,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _gather_along(tensor, dim, group):
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, tensor.detach(), group=group)
    return torch.cat(parts, dim=dim)


def _compare_with_unsplit(topology, sequence_parallel=False, **config_fields):
    """Max |difference| of logits, loss and every parameter gradient, TP model vs unsplit model."""
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel import gather_from_tensor_parallel_region, parallelize
    from llmstack.parallel.tensor_parallel import split_dim

    torch.manual_seed(0)
    full = LLMStackForCausalLM(LLMStackConfig(**config_fields))
    split = parallelize(copy.deepcopy(full), topology, sequence_parallel=sequence_parallel)
    input_ids = torch.randint(0, full.config.vocab_size, (2, 16))
    labels = input_ids.clone()
    labels[0, :5] = -100
    expected, actual = full(input_ids, labels=labels), split(input_ids, labels=labels)
    expected.loss.backward()
    actual.loss.backward()

    group = topology.tensor_parallel_group
    # Training returns the loss alone; the logits come from a call without labels.
    expected_logits, actual_logits = full(input_ids).logits, split(input_ids).logits
    logits = gather_from_tensor_parallel_region(actual_logits, group, split.lm_head.output_sizes)
    split_params = dict(split.named_parameters(remove_duplicate=False))
    grad_diff, shards_are_smaller = 0.0, True
    for name, param in full.named_parameters():
        grad, dim = split_params[name].grad, split_dim(name)
        if dim is not None:
            shards_are_smaller &= grad.shape[dim] < param.shape[dim]
            grad = _gather_along(grad, dim, group)
        grad_diff = max(grad_diff, (grad - param.grad).abs().max().item())
    return {
        "logits": (logits - expected_logits).abs().max().item(),
        "loss": (actual.loss - expected.loss).abs().item(),
        "grads": grad_diff,
        "shards_are_smaller": shards_are_smaller,
    }


def _cross_entropy_checks(topology):
    from llmstack.parallel import vocab_parallel_cross_entropy
    from llmstack.parallel.mappings import shard_sizes

    torch.manual_seed(1)
    vocab, rank = 37, topology.tensor_parallel_rank
    logits = torch.randn(3, 10, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (3, 10))
    targets[1, 2:7] = -100
    sizes = shard_sizes(vocab, topology.tensor_parallel_size)
    shard = logits.detach()[..., sum(sizes[:rank]) : sum(sizes[: rank + 1])].clone().requires_grad_()
    out = {}
    for smoothing in (0.0, 0.1):
        expected = F.cross_entropy(
            logits.view(-1, vocab), targets.view(-1), ignore_index=-100, label_smoothing=smoothing
        )
        (expected_grad,) = torch.autograd.grad(expected, logits)
        loss = vocab_parallel_cross_entropy(
            shard, targets, label_smoothing=smoothing, group=topology.tensor_parallel_group, vocab_size=vocab
        )
        (grad,) = torch.autograd.grad(loss, shard)
        grad = _gather_along(grad, -1, topology.tensor_parallel_group)
        out[smoothing] = ((loss - expected).abs().item(), (grad - expected_grad).abs().max().item())
    return out


def _chunked_cross_entropy_checks(topology):
    """Max |difference| of (loss, hidden grad, weight-shard grad), per option set of
    tests/test_loss_chunked.py, between the vocabulary-parallel losses (from logits, and chunked from
    hidden states) and causal_lm_loss on the whole logits."""
    from test_loss_chunked import OPTIONS, _inputs, _loss_and_grads, _max_difference, _whole_logits_loss

    import llmstack.models.loss as loss_module
    from llmstack.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

    loss_module.CHUNK_LOGITS = 6 * 4  # 4 tokens of a 6-row shard a chunk
    hidden, weight, targets = _inputs(vocab=11)  # 11 = 6 + 5 rows: an uneven split
    rows = slice(0, 6) if topology.tensor_parallel_rank == 0 else slice(6, 11)
    group = topology.tensor_parallel_group

    def from_logits(hidden, weight_shard, targets, **options):
        return vocab_parallel_cross_entropy(hidden @ weight_shard.t(), targets, group=group, vocab_size=11, **options)

    def chunked(hidden, weight_shard, targets, **options):
        return vocab_parallel_linear_cross_entropy(hidden, weight_shard, targets, group=group, vocab_size=11, **options)

    differences = []
    for options in OPTIONS:
        loss, hidden_grad, weight_grad = _loss_and_grads(_whole_logits_loss, hidden, weight, targets, **options)
        for loss_fn in (from_logits, chunked):
            # The hidden gradient here is this rank's part; the tensor-parallel region sums the parts.
            actual = _loss_and_grads(loss_fn, hidden, weight[rows], targets, **options)
            torch.distributed.all_reduce(actual[1], group=group)
            differences.append(_max_difference(actual, [loss, hidden_grad, weight_grad[rows]]))
    return differences


def _dropout_checks(topology):
    import torch.distributed as dist
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel import model_parallel_seed, parallelize, tensor_parallel_rng
    from llmstack.parallel.random import TENSOR_PARALLEL_RNG

    group = topology.tensor_parallel_group
    config = LLMStackConfig(**UNEVEN, attention_dropout=0.5, hidden_dropout=0.2)
    torch.manual_seed(0)
    model = parallelize(LLMStackForCausalLM(config), topology).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    try:
        model(input_ids)
        unseeded_error = None
    except RuntimeError as e:
        unseeded_error = str(e)

    model_parallel_seed(1234, topology)
    outside = torch.rand(8)
    with tensor_parallel_rng():
        inside = torch.rand(8)
    tp_state = get_cuda_rng_tracker().get_states()[TENSOR_PARALLEL_RNG].clone()
    hidden = model.model(input_ids)
    tp_stream_used = not torch.equal(tp_state, get_cuda_rng_tracker().get_states()[TENSOR_PARALLEL_RNG])

    def same_on_all_ranks(t):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return all(torch.equal(parts[0], p) for p in parts)

    return {
        "unseeded_error": unseeded_error,
        "outside_agrees": same_on_all_ranks(outside),
        "inside_differs": not same_on_all_ranks(inside),
        "replicated_hidden_agrees": same_on_all_ranks(hidden.detach()),
        "tp_stream_used": tp_stream_used,
    }


def _user_errors(topology):
    from llmstack.errors import UserError
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel import Topology, parallelize

    messages = {}
    for key, fields in {
        "heads": {"hidden_size": 48, "num_attention_heads": 3},
        "kv_heads": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1},
    }.items():
        model = LLMStackForCausalLM(LLMStackConfig(vocab_size=64, intermediate_size=64, num_hidden_layers=1, **fields))
        try:
            parallelize(model, topology)
        except UserError as e:
            messages[key] = str(e)
    try:
        Topology(tensor_parallel_size=3)
    except UserError as e:
        messages["world_size"] = str(e)
    return messages


def _gather_checks(topology):
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel import gather_full_state_dict, parallelize

    torch.manual_seed(0)
    full = LLMStackForCausalLM(LLMStackConfig(**UNEVEN, tie_word_embeddings=False))
    gathered = gather_full_state_dict(parallelize(copy.deepcopy(full), topology), topology)
    if gathered is None:
        return None
    expected = full.state_dict()
    return sorted(gathered) == sorted(expected) and all(torch.equal(gathered[k], v) for k, v in expected.items())


def _comm_checks(topology):
    """Bytes per kind of one forward and backward, with and without sequence parallelism."""
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel import CommStats, parallelize

    config = LLMStackConfig(**UNEVEN)
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    out = {}
    for sequence_parallel in (False, True):
        model = parallelize(LLMStackForCausalLM(config), topology, sequence_parallel=sequence_parallel)
        stats = CommStats()
        with stats:
            model(input_ids, labels=input_ids).loss.backward()
        out[sequence_parallel] = {"bytes": dict(stats.bytes), "metrics": stats.as_metrics()}
    return out


def _layer_checks(topology):
    """Max |difference| of outputs and gradients against nn.Linear(16, 13) (13 splits unevenly) of a
    column-parallel layer gathering its output and a row-parallel layer splitting its input."""
    from llmstack.parallel import ColumnParallelLinear, RowParallelLinear

    group = topology.tensor_parallel_group
    torch.manual_seed(2)
    x = torch.randn(3, 5, 16)
    out = {}
    # The weight's split dimension; the column layer's bias is split too, the row layer's replicated.
    for name, parallel_class, kwargs, weight_dim, bias_dim in [
        ("column", ColumnParallelLinear, {"gather_output": True}, 0, 0),
        ("row", RowParallelLinear, {"input_is_parallel": False}, 1, None),
    ]:
        full = torch.nn.Linear(16, 13)
        layer = parallel_class.from_linear(full, group, **kwargs)
        x_full, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, actual = full(x_full), layer(x_split)
        expected.square().sum().backward()
        actual.square().sum().backward()
        diffs = [actual - expected, x_split.grad - x_full.grad]
        for param_name, dim in (("weight", weight_dim), ("bias", bias_dim)):
            grad = getattr(layer, param_name).grad
            if dim is not None:
                grad = _gather_along(grad, dim, group)
            diffs.append(grad - getattr(full, param_name).grad)
        out[name] = max(d.abs().max().item() for d in diffs)
    return out


def _tensor_parallel_checks(rank, world_size):
    from llmstack.parallel import Topology

    topology = Topology(tensor_parallel_size=2)
    return {
        "tied_swiglu": _compare_with_unsplit(
            topology, **UNEVEN, num_key_value_heads=2, label_smoothing=0.1, z_loss=1e-3
        ),
        "untied_gelu_post_ln": _compare_with_unsplit(
            topology, **UNEVEN, tie_word_embeddings=False, activation="gelu", norm_position="post"
        ),
        "sequence_parallel": _compare_with_unsplit(topology, sequence_parallel=True, **UNEVEN, num_key_value_heads=2),
        "focal_smoothing": _compare_with_unsplit(topology, **UNEVEN, focal_gamma=2.0, label_smoothing=0.1),
        "layers": _layer_checks(topology),
        "cross_entropy": _cross_entropy_checks(topology),
        "chunked_cross_entropy": _chunked_cross_entropy_checks(topology),
        "dropout": _dropout_checks(topology),
        "errors": _user_errors(topology),
        "gathered": _gather_checks(topology),
        "comm": _comm_checks(topology),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_tensor_parallel_checks, world_size=2)


@pytest.mark.parametrize("variant", ["tied_swiglu", "untied_gelu_post_ln", "sequence_parallel", "focal_smoothing"])
def test_tensor_parallel_2_equals_unsplit_logits_loss_and_every_gradient(ranks, variant):
    for result in ranks:
        diffs = result[variant]
        assert diffs["shards_are_smaller"]
        assert diffs["logits"] < TOL and diffs["loss"] < TOL and diffs["grads"] < TOL, diffs


def test_column_and_row_parallel_layers_equal_linear_with_gathered_output_and_split_input(ranks):
    for result in ranks:
        assert result["layers"]["column"] < TOL and result["layers"]["row"] < TOL, result["layers"]


def test_vocab_parallel_cross_entropy_equals_cross_entropy_with_ignore_index_and_smoothing(ranks):
    for result in ranks:
        for smoothing, (loss_diff, grad_diff) in result["cross_entropy"].items():
            assert loss_diff < TOL and grad_diff < TOL, (smoothing, loss_diff, grad_diff)


def test_vocab_parallel_losses_with_smoothing_z_loss_and_focal_equal_the_whole_logits_loss(ranks):
    for result in ranks:
        assert max(result["chunked_cross_entropy"]) < TOL, result["chunked_cross_entropy"]


def test_dropout_differs_inside_the_tensor_parallel_region_and_agrees_outside(ranks):
    dropout = ranks[0]["dropout"]
    assert "model_parallel_seed" in dropout["unseeded_error"]
    assert dropout["outside_agrees"] and dropout["inside_differs"]
    assert dropout["replicated_hidden_agrees"] and dropout["tp_stream_used"]


def test_indivisible_heads_and_world_size_raise_user_errors(ranks):
    errors = ranks[0]["errors"]
    assert "must divide the number of attention heads (3)" in errors["heads"]
    assert "possible sizes for this model: 1, 3" in errors["heads"]
    assert "key/value heads (1)" in errors["kv_heads"]
    assert "world size (2 processes) must be a multiple of train.tensor_parallel_size (3)" in errors["world_size"]


def test_gathered_state_dict_equals_the_unsplit_model(ranks):
    assert ranks[0]["gathered"] is True
    assert ranks[1]["gathered"] is None


def test_comm_stats_count_the_tensor_parallel_collectives(ranks):
    batch, seq = 2, 16
    tokens, hidden, layers = batch * seq, UNEVEN["hidden_size"], UNEVEN["num_hidden_layers"]
    activation = 4 * tokens * hidden  # bytes of one fp32 (tokens, hidden) activation
    cross_entropy = 4 * 3 * tokens  # the max logit and 2 sums per token
    # Forward: the embedding and 2 per layer (o_proj, down_proj) leave the region; backward: 2 per
    # layer (attention, MLP) and the output layer's input enter it. Each is an all-reduce, or with
    # sequence parallelism an all-gather one way and a reduce-scatter the other.
    region_crossings = 4 * layers + 2
    plain = ranks[0]["comm"][False]
    assert plain["bytes"] == {"all_reduce": region_crossings * activation + cross_entropy}
    assert plain["metrics"]["comm/all_reduce_bytes"] == plain["bytes"]["all_reduce"]
    assert plain["metrics"]["comm/all_gather_bytes"] == 0
    # Sequence parallelism adds the all-reduce of the norms' gradients (2 per layer and the final one).
    norm_grads = 4 * hidden * (2 * layers + 1)
    assert ranks[0]["comm"][True]["bytes"] == {
        "all_gather": region_crossings * activation,
        "reduce_scatter": region_crossings * activation,
        "all_reduce": cross_entropy + norm_grads,
    }


def test_merging_a_directory_without_model_states_is_a_user_error(tmp_path):
    from llmstack.errors import UserError
    from llmstack.models import LLMStackConfig
    from llmstack.parallel import load_full_state_dict

    with pytest.raises(UserError, match="holds no DeepSpeed model states"):
        load_full_state_dict(tmp_path, LLMStackConfig(**UNEVEN))
    with pytest.raises(UserError, match="not found"):
        load_full_state_dict(tmp_path / "missing", LLMStackConfig(**UNEVEN))
