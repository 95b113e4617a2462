"""Communication per training step for one model in three 4-rank layouts, measured vs analytic.

Layouts: data 4, tensor 2 x data 2, pipeline 2 x data 2; DeepSpeed ZeRO-1, fp32, the same global
batch. Measured: `llmstack.parallel.CommStats` around one step (after a warm-up step), summed over
the ranks. Analytic: the count from the model's shapes below. Target: every kind within 5%.

    python bench/bench_comm.py

With options it runs the gradient compression methods instead (none, int8, top-k 1%, 1-bit Adam;
2 ranks, bench/bench_compression.py, whose options it takes): step time per shaped link rate,
bytes per step against the analytic count, and the bandwidth below which each method pays.

    python bench/bench_comm.py --link-mbit 100 1000 10000 --micro-batch 1 --seq 64 --overlap
"""

import sys
from functools import partial

import torch

from llmstack.testing import run_distributed

CONFIG = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
}
MICRO_BATCH, SEQ, GLOBAL_BATCH = 2, 64, 16
BYTES = 4  # fp32
LAYOUTS = {
    "data 4": {},
    "tensor 2 x data 2": {"tensor_parallel_size": 2},
    "pipeline 2 x data 2": {"pipeline_parallel_size": 2},
}
KINDS = ("all_reduce", "all_gather", "point_to_point")


def ds_config(data_parallel_size):
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO_BATCH * data_parallel_size),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


def _pipeline_step(engine, batches):
    engine.train_batch(batches)


def _engine_step(engine, batch):
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(batch, shift_labels=batch).loss)
        engine.step()


def _measure(rank, world_size):
    import deepspeed

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.parallel import CommStats, Topology, parallelize, to_pipeline

    deepspeed.init_distributed(verbose=False)
    measured = {}
    for name, sizes in LAYOUTS.items():
        topology = Topology(**sizes)
        config = ds_config(topology.data_parallel_size)
        torch.manual_seed(0)
        model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
        batch = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ))
        if topology.pipeline_parallel_size > 1:
            pipe = to_pipeline(model, topology)
            engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=config)
            step = partial(_pipeline_step, engine, iter([(batch, batch)] * 1000))
        else:
            if topology.tensor_parallel_size > 1:
                parallelize(model, topology)
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config, mpu=topology
            )
            step = partial(_engine_step, engine, batch)
        step()  # warm-up: the pipeline engine exchanges tensor shapes on its first step only
        stats = CommStats()
        with stats:
            step()
        measured[name] = dict(stats.bytes)
    return measured


def analytic(name):
    """Bytes per step by kind, summed over the 4 ranks, in CommStats' convention (the whole buffer
    of each collective, as seen by each rank taking part)."""
    from deepspeed.runtime.utils import partition_balanced

    from llmstack.models import LLMStackConfig

    c = LLMStackConfig(**CONFIG)
    h, vocab, layers = c.hidden_size, c.vocab_size, c.num_hidden_layers
    # Split by tensor parallelism: projections and the (tied) embedding; replicated: the norms.
    layer_split = h * c.head_dim * 2 * (c.num_attention_heads + c.num_key_value_heads) + 3 * h * c.intermediate_size
    layer_replicated = 2 * h
    split, replicated = vocab * h + layers * layer_split, layers * layer_replicated + h
    sizes = LAYOUTS[name]
    tp, pp = sizes.get("tensor_parallel_size", 1), sizes.get("pipeline_parallel_size", 1)
    dp = 4 // (tp * pp)
    micro_batches, tokens = GLOBAL_BATCH // (MICRO_BATCH * dp), MICRO_BATCH * SEQ
    if pp > 1:
        # Pipeline layers: embedding, decoder layers, final norm, tied output layer (a second copy
        # of the embedding on the last stage), split where DeepSpeed balances parameter counts.
        weights = [vocab * h] + [layer_split + layer_replicated] * layers + [h, vocab * h]
        parts = partition_balanced(weights=weights, num_parts=pp)
        stage_params = sum(sum(weights[parts[s] : parts[s + 1]]) for s in range(pp))
        return {
            # ZeRO-1: gradients all-reduced over data ranks, updated parameters all-gathered;
            # the tied embedding's gradient all-reduced between the first and last stage.
            "all_reduce": dp * (stage_params + 2 * vocab * h) * BYTES,
            "all_gather": dp * stage_params * BYTES,
            # Per micro-batch and stage boundary: activations forward, gradients backward, each
            # counted by the sender and the receiver.
            "point_to_point": dp * (pp - 1) * micro_batches * 4 * tokens * h * BYTES,
        }
    params_per_replica = split + tp * replicated
    # Per micro-batch on every rank, all-reduces of (tokens, hidden): forward, the embedding and 2
    # per layer; backward, 2 per layer and the output layer's input. Cross entropy: 3 per token.
    tensor_parallel = tp * dp * micro_batches * ((4 * layers + 2) * tokens * h + 3 * tokens) if tp > 1 else 0
    return {
        "all_reduce": (dp * params_per_replica + tensor_parallel) * BYTES,
        "all_gather": dp * params_per_replica * BYTES,
        "point_to_point": 0,
    }


def main():
    if len(sys.argv) > 1:
        from bench_compression import main as compression_main

        return compression_main()
    per_rank = run_distributed(_measure, world_size=4)
    worst = 0.0
    print(f"model {CONFIG}, global batch {GLOBAL_BATCH} x {SEQ} tokens, fp32, ZeRO-1; MB per step, all ranks")
    print(f"{'layout':<22}{'kind':<16}{'measured':>11}{'analytic':>11}{'ratio':>8}")
    for name in LAYOUTS:
        expected = analytic(name)
        for kind in KINDS:
            measured = sum(rank[name].get(kind, 0) for rank in per_rank)
            ratio = measured / expected[kind] if expected[kind] else float(measured == 0)
            worst = max(worst, abs(ratio - 1))
            print(f"{name:<22}{kind:<16}{measured / 1e6:>11.3f}{expected[kind] / 1e6:>11.3f}{ratio:>8.3f}")
        total = sum(sum(rank[name].values()) for rank in per_rank)
        print(f"{name:<22}{'total':<16}{total / 1e6:>11.3f}{sum(expected.values()) / 1e6:>11.3f}")
    print(f"largest deviation from the analytic count: {worst:.2%} (target <= 5%)")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
