"""Continued pretraining: `model.init_from` starts `llmstack train` from a stock transformers model's
weights under every layout (the first loss is the stock model's loss on the same batch), and ZeRO-3
builds the model partitioned from the start with the weights whole construction gives."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_run_config
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from llmstack.cli.main import main
from llmstack.data.blocks import PackedBlocks
from llmstack.errors import UserError
from llmstack.testing import run_distributed

SEQ_LEN = 32  # tiny_run_config's
ZERO0 = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW"}, "steps_per_print": 1000000}
# The Done-when bound (fp32). Measured (one run, 9 layout x model pairs): 2.4e-7 to 9.5e-7.
LOSS_TOLERANCE = 1e-4


def stock_model_dir(root, tiny_data, kind):
    """A small random stock Qwen2 (q/k/v biases, sliding window on layer 1, yarn RoPE, untied head)
    or Llama (GQA, tied head) saved with the tiny tokenizer; returns (dir, model)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_data["tokenizer"])
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    if kind == "qwen2":
        config = Qwen2Config(
            **shape,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 1e4,
            },
        )
        model = Qwen2ForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)  # biases and norm gains off their init values
    path = root / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval()


def first_batch_loss(model, tiny_data, samples):
    """The stock model's mean loss over the first `samples` samples the trainer reads (its first step)."""
    data = PackedBlocks(tiny_data["train"], SEQ_LEN, seed=1234)
    batch = data.collate([data.sample(i) for i in range(samples)])
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def first_losses(rank, world_size, runs):
    from llmstack.training import Trainer
    from llmstack.training.config import parse_run_config

    losses = {}
    for name, (raw, ds_config) in runs.items():
        Trainer(parse_run_config(raw), ds_config_path=ds_config).train()
        with open(f"{raw['train']['out_dir']}/metrics.jsonl") as f:
            losses[name] = next(r["loss"] for r in map(json.loads, f) if "loss" in r)
    return losses


LAYOUTS = {
    "zero0": ("zero0", {}),
    "zero1": ("ds_configs/zero1.json", {}),
    "zero2": ("ds_configs/zero2.json", {}),
    "zero3": ("ds_configs/zero3.json", {}),
    "zero3_offload": ("ds_configs/zero3_offload.json", {}),
    "tensor2": ("ds_configs/zero1.json", {"tensor_parallel_size": 2}),
    "pipeline2": ("ds_configs/zero1.json", {"pipeline_parallel_size": 2, "grad_accum_steps": 2, "micro_batch_size": 2}),
}


def test_init_from_starts_every_layout_at_the_stock_models_loss(tmp_path, tiny_data):
    zero0 = tmp_path / "zero0.json"
    zero0.write_text(json.dumps(ZERO0))
    models = {kind: stock_model_dir(tmp_path, tiny_data, kind) for kind in ("qwen2", "llama")}
    # An llmstack directory too: the Qwen2 model imported (its tokenizer comes along).
    assert main(["import-hf", str(models["qwen2"][0]), str(tmp_path / "imported")]) in (0, None)
    models["llmstack"] = (tmp_path / "imported", models["qwen2"][1])
    data = {k: v for k, v in tiny_data.items() if k != "tokenizer"}  # the tokenizer comes from init_from
    runs, samples = {}, {}
    layouts = [("qwen2", name) for name in LAYOUTS] + [("llama", "zero3"), ("llama", "tensor2"), ("llmstack", "zero2")]
    for kind, layout in layouts:
        ds_config, train = LAYOUTS[layout]
        raw = tiny_run_config(data, tmp_path / f"{kind}-{layout}", max_steps=1, **train)
        raw["model"] = {"init_from": str(models[kind][0])}
        runs[f"{kind}-{layout}"] = (raw, str(zero0) if ds_config == "zero0" else ds_config)
        t = raw["train"]
        data_parallel = 2 // (t.get("tensor_parallel_size", 1) * t.get("pipeline_parallel_size", 1))
        samples[f"{kind}-{layout}"] = t["micro_batch_size"] * t.get("grad_accum_steps", 1) * data_parallel
    losses = run_distributed(first_losses, 2, args=(runs,))[0]
    for name, loss in losses.items():
        kind = name.split("-")[0]
        expected = first_batch_loss(models[kind][1], tiny_data, samples[name])
        assert abs(loss - expected) <= LOSS_TOLERANCE, (name, loss, expected)


def partitioned_equals_whole(rank, world_size, model_fields, tokenizer_dir, ds_config):
    """Whole and ZeRO-3-partitioned construction from the same seed (and init_from, if given):
    the names of the parameters whose consolidated values differ."""
    import deepspeed

    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.parallel import Topology
    from llmstack.training.construct import build_model
    from llmstack.training.distributed import init_distributed
    from llmstack.training.trainer import param_groups, seed_everything

    init_distributed()
    topology = Topology()
    tokenizer = load_tokenizer(tokenizer_dir)
    built = {}
    for stage in (0, 3):
        seed_everything(1234)
        built[stage] = build_model(
            model_fields, tokenizer, SEQ_LEN, {**ds_config, "zero_optimization": {"stage": stage}}, topology
        )
    partitioned = dict(built[3].named_parameters())
    assert all(hasattr(p, "ds_id") for p in partitioned.values())  # built partitioned, never whole
    differ = []
    # Weight decay goes to the same parameters (matrices) whether or not they are partitioned.
    groups = [
        [
            [n for n, p in built[s].named_parameters() if any(p is q for q in g["params"])]
            for g in param_groups(built[s], 0.1)
        ]
        for s in (0, 3)
    ]
    if groups[0] != groups[1]:
        differ.append("weight-decay groups")
    for name, whole in built[0].named_parameters():
        with deepspeed.zero.GatheredParameters([partitioned[name]]):
            if not torch.equal(partitioned[name].data, whole.data):
                differ.append(name)
    return differ


@pytest.mark.parametrize("init_from", [False, True])
def test_zero3_partitioned_construction_gives_the_whole_models_weights(tmp_path, tiny_data, init_from):
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        qkv_bias=True,
        tie_word_embeddings=False,
    )
    if init_from:
        fields = {"init_from": str(stock_model_dir(tmp_path, tiny_data, "qwen2")[0])}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}
    args = (fields, tiny_data["tokenizer"], ds_config)
    assert run_distributed(partitioned_equals_whole, 2, args=args) == [[], []]


def test_init_from_refuses_architecture_keys_and_missing_tokenizer(tmp_path, tiny_data):
    from llmstack.training.config import parse_run_config

    path, _ = stock_model_dir(tmp_path, tiny_data, "llama")
    raw = tiny_run_config(tiny_data, tmp_path / "run")
    raw["model"] = {"init_from": str(path), "hidden_size": 64, "z_loss": 1e-4}
    with pytest.raises(UserError, match="remove model.hidden_size"):
        parse_run_config(raw)
    raw["model"] = {"init_from": str(tmp_path)}
    with pytest.raises(UserError, match="not a model directory"):
        parse_run_config(raw)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    raw["model"] = {"init_from": str(path)}
    raw["data"].pop("tokenizer")
    with pytest.raises(UserError, match="has no tokenizer"):
        parse_run_config(raw)
    shutil.rmtree(path)


def test_init_from_extends_the_context_with_a_rope_variant(tmp_path, tiny_data):
    """Continued pretraining at a longer context: max_position_embeddings and rope_parameters beside
    init_from. The run starts at the loss of the stock model configured with the same variant, whose
    rope_theta and original context default to the base model's, and the export carries them."""
    path, stock = stock_model_dir(tmp_path, tiny_data, "llama")  # trained context: 64 positions
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    raw = tiny_run_config({k: v for k, v in tiny_data.items() if k != "tokenizer"}, tmp_path / "run", max_steps=1)
    raw["model"] = {"init_from": str(path), "max_position_embeddings": 512, "rope_parameters": rope}
    zero0 = tmp_path / "zero0.json"
    zero0.write_text(json.dumps(ZERO0))
    (loss,) = run_distributed(first_losses, 1, args=({"extended": (raw, str(zero0))},))[0].values()
    expected_rope = {
        **rope,
        "rope_theta": stock.config.rope_parameters["rope_theta"],
        "original_max_position_embeddings": 64,
    }
    extended = LlamaForCausalLM(
        LlamaConfig(**{**stock.config.to_dict(), "max_position_embeddings": 512, "rope_parameters": expected_rope})
    )
    extended.load_state_dict(stock.state_dict())
    assert abs(loss - first_batch_loss(extended.eval(), tiny_data, 4)) <= LOSS_TOLERANCE
    assert abs(loss - first_batch_loss(stock, tiny_data, 4)) > 1e-3  # the variant changes the logits
    assert main(["export-hf", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf"), "--format", "llama"]) in (
        0,
        None,
    )
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["max_position_embeddings"], exported["rope_parameters"]) == (512, expected_rope)
    raw["model"]["rope_parameters"] = {"rope_type": "yarn"}
    with pytest.raises(UserError, match="rope_parameters.*factor"):
        from llmstack.training.config import parse_run_config

        parse_run_config(raw)
