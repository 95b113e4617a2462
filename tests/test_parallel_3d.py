"""Tensor parallelism composed with data and with pipeline parallelism, on 4 gloo ranks.

One launch trains two layouts with DeepSpeed (ZeRO-1): data 2 x tensor 2 through the plain engine
(`mpu=topology`), pipeline 2 x tensor 2 through the pipeline engine. Each returns its losses, its
logits on a probe batch, the gathered full state dict and a saved DeepSpeed checkpoint. The test
process checks them against the unsplit model trained with torch's AdamW on the same batches, and
exports the gathered and the checkpointed weights to Hugging Face models.
"""

import pytest
import torch

from llmstack.testing import run_distributed

STEPS, MICRO_BATCH_SIZE, SEQ, LR = 4, 2, 16, 1e-2
# Clipping is on (DeepSpeed's default), so the gradient norm must be summed correctly over the
# tensor- and pipeline-parallel shards, replicated parameters once.
CLIP = 1.0
# Vocabulary 131 does not divide by the tensor-parallel size: split unevenly.
CONFIG = {
    "vocab_size": 131,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# layout -> (topology sizes, micro-batches per step on each data-parallel rank)
LAYOUTS = {
    "data2_tensor2": ({"tensor_parallel_size": 2}, 2),
    "pipeline2_tensor2": ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
}
MICRO_BATCHES_PER_STEP = 4  # data-parallel size x micro-batches per rank, in both layouts


def make_model():
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM

    torch.manual_seed(0)
    return LLMStackForCausalLM(LLMStackConfig(**CONFIG))


def make_batches():
    """STEPS lists of MICRO_BATCHES_PER_STEP (input_ids, shift_labels) micro-batches."""
    generator = torch.Generator().manual_seed(1)
    # A repeated pattern, so that a few steps visibly lower the loss.
    pattern = torch.randint(0, CONFIG["vocab_size"], (8,), generator=generator)
    steps = []
    for _ in range(STEPS):
        step = []
        for _ in range(MICRO_BATCHES_PER_STEP):
            offsets = torch.randint(0, 8, (MICRO_BATCH_SIZE, 1), generator=generator)
            tokens = pattern[(offsets + torch.arange(SEQ + 1)) % 8]
            step.append((tokens[:, :-1], tokens[:, 1:].clone()))
        steps.append(step)
    return steps


def probe_batch():
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(2))
    return tokens, tokens.clone()


def ds_config(micro_batches):
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }


def _train_data_tensor(topology, micro_batches, checkpoint_dir):
    import deepspeed
    import torch.distributed as dist

    from llmstack.parallel import gather_from_tensor_parallel_region, gather_full_state_dict, parallelize

    model = parallelize(make_model(), topology)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(micro_batches), mpu=topology
    )
    losses = []
    for step in make_batches():
        mine = step[topology.data_parallel_rank * micro_batches : (topology.data_parallel_rank + 1) * micro_batches]
        total = torch.zeros(())
        for input_ids, labels in mine:
            loss = engine(input_ids, shift_labels=labels).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / micro_batches
        dist.all_reduce(total, group=topology.data_parallel_group)
        losses.append(total.item() / topology.data_parallel_size)
    engine.eval()
    with torch.no_grad():
        logits = engine(probe_batch()[0]).logits
    logits = gather_from_tensor_parallel_region(logits, topology.tensor_parallel_group, model.lm_head.output_sizes)
    engine.save_checkpoint(checkpoint_dir, tag="final")
    return losses, logits, gather_full_state_dict(engine.module, topology)


def _train_pipeline_tensor(topology, micro_batches, checkpoint_dir):
    import deepspeed

    from llmstack.parallel import gather_from_tensor_parallel_region, gather_full_state_dict, to_pipeline
    from llmstack.parallel.mappings import shard_sizes

    pipe = to_pipeline(make_model(), topology)
    engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=ds_config(micro_batches))
    batches = iter([micro_batch for step in make_batches() for micro_batch in step])
    losses = [engine.train_batch(batches).item() for _ in range(STEPS)]
    _, logits = engine.eval_batch(iter([probe_batch()]), return_logits=True, num_micro_batches=1)
    if engine.is_last_stage():
        sizes = shard_sizes(CONFIG["vocab_size"], topology.tensor_parallel_size)
        logits = gather_from_tensor_parallel_region(logits, topology.tensor_parallel_group, sizes)
    engine.save_checkpoint(checkpoint_dir, tag="final")
    return losses, logits, gather_full_state_dict(engine.module, topology)


def _train_layouts(rank, world_size, root):
    import deepspeed

    from llmstack.parallel import Topology

    deepspeed.init_distributed(verbose=False)
    results = {}
    for name, train in [("data2_tensor2", _train_data_tensor), ("pipeline2_tensor2", _train_pipeline_tensor)]:
        sizes, micro_batches = LAYOUTS[name]
        topology = Topology(**sizes)
        losses, logits, state_dict = train(topology, micro_batches, f"{root}/{name}")
        results[name] = {
            "losses": losses,
            "logits": logits,
            "state_dict": state_dict,
            "last_stage": topology.pipeline_parallel_rank == topology.pipeline_parallel_size - 1,
        }
    return results


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel_3d")


@pytest.fixture(scope="module")
def ranks(checkpoint_root):
    return run_distributed(_train_layouts, world_size=4, args=(str(checkpoint_root),))


@pytest.fixture(scope="module")
def unsplit_losses():
    from llmstack.models.modeling_llmstack import causal_lm_loss

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in make_batches():
        total = 0.0
        for input_ids, labels in step:
            loss = causal_lm_loss(model(input_ids).logits, labels) / len(step)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def hf_logits(state_dict, tmp_path):
    """Logits on the probe batch of the Hugging Face model exported from `state_dict`."""
    from transformers import AutoModelForCausalLM

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM

    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
    model.load_state_dict(state_dict)
    model.save_pretrained(tmp_path)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        return exported(probe_batch()[0]).logits


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_trains_as_the_unsplit_model_with_falling_loss(ranks, unsplit_losses, layout):
    losses = ranks[0][layout]["losses"]
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exported_model_logits_equal_the_parallel_model(ranks, layout, tmp_path):
    parallel_logits = next(r[layout]["logits"] for r in ranks if r[layout]["last_stage"])
    gathered = ranks[0][layout]["state_dict"]
    assert all(r[layout]["state_dict"] is None for r in ranks[1:])
    assert (hf_logits(gathered, tmp_path) - parallel_logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saved_checkpoint_merges_to_the_gathered_weights(ranks, checkpoint_root, layout):
    from llmstack.models import LLMStackConfig
    from llmstack.parallel import is_model_parallel_checkpoint, load_full_state_dict

    tag_dir = checkpoint_root / layout / "final"
    assert is_model_parallel_checkpoint(tag_dir)
    merged = load_full_state_dict(tag_dir, LLMStackConfig(**CONFIG))
    gathered = ranks[0][layout]["state_dict"]
    assert sorted(merged) == sorted(gathered)
    assert all(torch.equal(merged[name], tensor) for name, tensor in gathered.items())
