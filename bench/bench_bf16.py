"""bf16 on a CPU with native bf16 (AVX512-BF16 / AMX): llmstack trained through DeepSpeed with
ds_configs/bf16_zero2.json against transformers' LlamaForCausalLM in fp32, on bench_train.py's shape
(same model, batch and step functions), interleaved rounds in one process (bench_train's `one_round`).

Targets (issue 17, item 2a): bf16 tokens/s >= 1.8x transformers' fp32; with --loss-steps 300, the
loss after 300 steps (mean of the last 20) within 2% of the same run with ds_configs/zero2.json (fp32),
on byte tokens of the Python standard library's sources (the same batches for both).

    python bench/bench_bf16.py [--steps 4] [--rounds 3] [--loss-steps 300] [--cpu-time]

--cpu-time: one thread, timed by its CPU time, as bench_train.py's (for machines shared with other jobs).
"""

import argparse
import sysconfig
import time
from pathlib import Path

import torch
from bench_train import BATCH, SEQ, adamw, engine_step, llama_step, one_round, spread  # bench/bench_train.py
from timing import BASELINE_MODEL  # bench/timing.py

from llmstack import LLMStackConfig, LLMStackForCausalLM, to_llama
from llmstack.training.config import TrainConfig
from llmstack.training.ds_config import complete_ds_config, load_ds_config
from llmstack.training.precision import cpu_bf16_report

TINY_MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
DS_CONFIGS = Path(__file__).resolve().parent.parent / "ds_configs"


def engine_for(ds_config_name: str, config: LLMStackConfig, micro_batch: int):
    import deepspeed

    torch.manual_seed(0)
    model = LLMStackForCausalLM(config).train()
    train = TrainConfig(micro_batch_size=micro_batch, grad_accum_steps=1, lr=1e-3, weight_decay=0.0)
    ds_config = complete_ds_config(load_ds_config(DS_CONFIGS / ds_config_name), train, dp_size=1)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


def stdlib_batches(steps: int, batch: int, seq: int) -> torch.Tensor:
    """(steps, batch, seq + 1) byte tokens of the standard library's .py files, in path order."""
    need = steps * batch * (seq + 1)
    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= need:
            break
    return torch.tensor(list(data[:need]), dtype=torch.long).view(steps, batch, seq + 1)


def final_loss(ds_config_name: str, config: LLMStackConfig, batches: torch.Tensor) -> float:
    engine = engine_for(ds_config_name, config, batches.shape[1])
    losses = []
    for batch in batches:
        loss = engine(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loss-steps", type=int, default=0, help="also compare the loss after this many steps")
    parser.add_argument(
        "--loss-model",
        choices=["bench", "tiny"],
        default="bench",
        help="model of the loss comparison: the bench shape, or a tiny one (hidden 128, 2 layers, batch 8 x 128)",
    )
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time (loaded machines)")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)

    from llmstack.training.distributed import init_distributed

    init_distributed()
    report = cpu_bf16_report(probe=True)
    print(f"CPU bf16: {report.describe()}, {torch.get_num_threads()} threads", flush=True)
    if not report.native:
        print("no native bf16 on this CPU: bf16 training would be emulated (~30x slower than fp32); nothing to compare")
        return
    config = LLMStackConfig(**BASELINE_MODEL)
    if args.rounds:
        torch.manual_seed(0)
        batch = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
        llama = to_llama(LLMStackForCausalLM(config)).train()
        loops = {
            "transformers Llama fp32": (llama_step, llama, adamw(llama)),
            "llmstack bf16_zero2": (engine_step, engine_for("bf16_zero2.json", config, BATCH), None),
        }
        for step, model, opt in loops.values():
            step(model, opt, batch)  # warm-up
        ratios = []
        for r in range(args.rounds):
            rates = one_round(loops, batch, args.steps, clock)
            ratios.append(rates["llmstack bf16_zero2"] / rates["transformers Llama fp32"])
            print(f"round {r + 1}: " + ", ".join(f"{n} {v:.0f} tok/s" for n, v in rates.items()), flush=True)
        print(f"llmstack bf16 / transformers fp32: {spread(ratios)} over {args.rounds} rounds (target >= 1.8x)")
    if args.loss_steps:
        if args.loss_model == "tiny":
            config = LLMStackConfig(**TINY_MODEL)
        batches = stdlib_batches(args.loss_steps, BATCH, SEQ if args.loss_model == "bench" else 128)
        fp32, bf16 = final_loss("zero2.json", config, batches), final_loss("bf16_zero2.json", config, batches)
        print(
            f"{args.loss_model} model, loss after {args.loss_steps} steps (mean of the last 20): "
            f"fp32 {fp32:.4f}, bf16 {bf16:.4f}, "
            f"bf16/fp32 - 1 = {bf16 / fp32 - 1:+.2%} (target within 2%)"
        )


if __name__ == "__main__":
    main()
