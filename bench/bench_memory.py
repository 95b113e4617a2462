"""Per-rank memory of ZeRO stages 0-3 with and without offload, 2 data-parallel ranks, fp32.

Counted by `llmstack.training.memory.zero_memory_report` from the tensors each rank holds,
between the second backward and step. Ratios are against ZeRO-0 measured in the same run; the
targets with 2 ranks: optimizer state 0.5 at stages 1-3, parameters 0.5 at stage 3. ZeRO-3 keeps
tensors under `stage3_param_persistence_threshold` elements (DeepSpeed's default 1e5) whole on
every rank; the rows marked "all partitioned" set it to 0, the last row shows the default. On a
CPU-only machine offloading moves nothing (the "cpu" column is everything); on a GPU it shows what
left the device.

    python bench/bench_memory.py
"""

import json
import sys
from pathlib import Path

import torch

from llmstack.testing import run_distributed

DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}
MICRO_BATCH, SEQ = 2, 64
ALL_PARTITIONED = {"stage3_param_persistence_threshold": 0}
# name -> (ds_configs file or None for plain ZeRO-0, extra zero_optimization keys)
SETUPS = {
    "zero0": (None, {}),
    "zero1": ("zero1", {}),
    "zero1 + optimizer offload": ("zero1", {"offload_optimizer": {"device": "cpu"}}),
    "zero2": ("zero2", {}),
    "zero2 + optimizer offload": ("zero2_offload", {}),
    "zero3, all partitioned": ("zero3", ALL_PARTITIONED),
    "zero3 + optimizer offload, all part.": ("zero3_offload", ALL_PARTITIONED),
    "zero3 + opt., param offload, all part.": ("zero3_param_offload", ALL_PARTITIONED),
    "zero3 (default persistence threshold)": ("zero3", {}),
}
ZERO0 = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW"}}
KINDS = ("parameters", "master_weights", "gradients", "optimizer_state")


def ds_config(name):
    file, zero_extra = SETUPS[name]
    config = json.loads((DS_CONFIGS / f"{file}.json").read_text()) if file else json.loads(json.dumps(ZERO0))
    config["zero_optimization"].update(zero_extra)
    config.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1)
    config["optimizer"].setdefault("params", {})["lr"] = 1e-3
    return config


def _measure(rank, world_size):
    import deepspeed

    from llmstack.models import LLMStackConfig, LLMStackForCausalLM
    from llmstack.training.memory import zero_memory_report

    reports = {}
    for name in SETUPS:
        torch.manual_seed(0)
        model = LLMStackForCausalLM(LLMStackConfig(**CONFIG))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(name))
        batch = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ))
        for step in range(2):
            engine.backward(engine(input_ids=batch, labels=batch).loss)
            if step == 1:
                reports[name] = zero_memory_report(engine)
            engine.step()
        del engine, model
    return reports


def main():
    per_rank = run_distributed(_measure, world_size=2)
    reports = per_rank[0]
    base = reports["zero0"]
    print(f"model {CONFIG}, 2 ranks, fp32; MiB per rank (rank 0), ratio to ZeRO-0 in brackets")
    print(f"{'setup':<40}" + "".join(f"{kind:>22}" for kind in KINDS) + f"{'cpu':>10}")
    for name, report in reports.items():
        cells = []
        for kind in KINDS:
            ratio = f"({report[kind] / base[kind]:.2f})" if base[kind] else ""
            cells.append(f"{report[kind] / 2**20:>14.2f} {ratio:>7}")
        print(f"{name:<40}" + "".join(cells) + f"{report['on_cpu'] / 2**20:>10.2f}")
    worst = max(
        [
            abs(r[name]["optimizer_state"] / r["zero0"]["optimizer_state"] - 0.5) / 0.5
            for r in per_rank
            for name in SETUPS
            if name != "zero0"
        ]
        + [
            abs(r[name]["parameters"] / r["zero0"]["parameters"] - 0.5) / 0.5
            for r in per_rank
            for name in SETUPS
            if name.startswith("zero3") and "part" in name
        ]
    )
    print(f"largest deviation from the 0.5 targets: {worst:.1%} (target <= 5%)")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
