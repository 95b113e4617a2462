"""Pipeline parallelism: 2 stages under DeepSpeed's pipeline engine train exactly as the unsplit model.

One 2-rank launch trains the same model three times (partitioned by parameters; uniformly with
activation checkpointing every layer; from the config alone) and returns the losses; the test
process trains the unsplit model with torch's AdamW on the same batches for reference.
"""

import pytest
import torch

from llmstack.testing import run_distributed

STEPS, MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ = 3, 4, 2, 16
LR = 1e-2
CLIP = 1.0
CONFIG = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}
REGULARIZED = {"label_smoothing": 0.1, "z_loss": 1e-3, "focal_gamma": 2.0}
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
    "gradient_accumulation_steps": MICRO_BATCHES,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "gradient_clipping": CLIP,
    "steps_per_print": 10**9,
}


def make_model():
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM

    torch.manual_seed(0)
    return LLMStackForCausalLM(LLMStackConfig(**CONFIG))


def make_batches():
    """STEPS x MICRO_BATCHES micro-batches of (input_ids, shift_labels), some labels ignored."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS * MICRO_BATCHES):
        tokens = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH_SIZE, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, :3] = -100
        batches.append((tokens[:, :-1], labels))
    return batches


def _train_pipelines(rank, world_size):
    import deepspeed

    from llmstack.models import LLMStackConfig
    from llmstack.parallel import Topology, to_pipeline

    deepspeed.init_distributed(verbose=False)
    topology = Topology(pipeline_parallel_size=2)
    losses = {}
    for name, source, kwargs in [
        ("parameters", make_model(), {"partition_method": "parameters"}),
        ("uniform_checkpointed", make_model(), {"partition_method": "uniform", "activation_checkpoint_interval": 1}),
        ("from_config", LLMStackConfig(**CONFIG), {}),
        ("regularized", LLMStackConfig(**CONFIG, **REGULARIZED), {}),
    ]:
        torch.manual_seed(0)
        pipe = to_pipeline(source, topology, **kwargs)
        engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=DS_CONFIG)
        head_calls = []
        pipe.output_layer().register_forward_hook(lambda *_, calls=head_calls: calls.append(1))
        batches = iter(make_batches())
        losses[name] = [engine.train_batch(batches).item() for _ in range(STEPS)]
        losses[name + "_stage_layers"] = pipe.parts
        losses[name + "_head_calls"] = [len(head_calls)]
        engine.eval_batch(iter(make_batches()[:MICRO_BATCHES]))
        losses[name + "_head_calls"].append(len(head_calls))
    return losses


@pytest.fixture(scope="module")
def pipeline_losses():
    return run_distributed(_train_pipelines, world_size=2)


def train_unsplit(**loss_options):
    from llmstack.models.modeling_llmstack import causal_lm_loss

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    batches = iter(make_batches())
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(MICRO_BATCHES):
            input_ids, labels = next(batches)
            loss = causal_lm_loss(model(input_ids).logits, labels, **loss_options) / MICRO_BATCHES
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


@pytest.fixture(scope="module")
def unsplit_losses():
    return train_unsplit()


def test_training_takes_the_chunked_loss_and_evaluation_the_logits(pipeline_losses):
    """The output layer (tied here) runs only in eval mode, on the last stage: training reads its
    weight a chunk of tokens at a time (the losses above equal the whole-logits loss)."""
    first_stage, last_stage = (rank_losses["from_config_head_calls"] for rank_losses in pipeline_losses)
    assert first_stage == [0, 0] and last_stage == [0, MICRO_BATCHES]


def test_the_pipeline_trains_with_label_smoothing_z_loss_and_focal_weighting(pipeline_losses):
    for rank_losses in pipeline_losses:
        assert rank_losses["regularized"] == pytest.approx(train_unsplit(**REGULARIZED), abs=1e-5)


@pytest.mark.parametrize("variant", ["parameters", "uniform_checkpointed", "from_config"])
def test_pipeline_2_loss_over_3_steps_equals_unsplit(pipeline_losses, unsplit_losses, variant):
    for rank_losses in pipeline_losses:
        assert rank_losses[variant] == pytest.approx(unsplit_losses, abs=1e-5)
    assert unsplit_losses[-1] < unsplit_losses[0]


def test_partition_methods_split_the_layers_as_asked(pipeline_losses):
    # 7 pipeline layers: embedding, 4 decoder layers, norm, tied output layer.
    assert pipeline_losses[0]["uniform_checkpointed_stage_layers"] == [0, 4, 7]
    by_parameters = pipeline_losses[0]["parameters_stage_layers"]
    assert by_parameters[0] == 0 and by_parameters[-1] == 7 and by_parameters != [0, 4, 7]
