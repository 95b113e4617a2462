"""Final validation loss of compressed training against uncompressed: the quickstart's model and
corpus (as `llmstack quickstart` builds them), 2 ranks, fp32, ZeRO-2, 300 steps per run.

Methods: none (AdamW), int8 gradient averaging (AdamW), top-k 1% (the run config's defaults: a
100-step dense warm-up, then BurstAdamW), and 1-bit Adam
(`--onebit-freeze-step`, default 60: a fifth of the run, after the learning-rate warm-up) at
ZeRO-2 ("onebit", its partitioned variant) and at ZeRO-0 ("onebit-zero0", for reference). Each
method runs with every seed of `--seeds` (the seed sets the model's initialization and the data
order); the report gives each method's final validation loss, its ratio to uncompressed with the
same seed, and the spread of that ratio over the seeds. Targets: int8 within 1%, top-k 1% within 3%,
1-bit Adam within 2%.

Runs already finished under `--out` (their result.json) are not repeated, so the bench can be
stopped and started again, and methods can run in separate invocations (`--methods`; the ratios
read the uncompressed runs from `--out`). The run directories hold each run's metrics.jsonl.

    python bench/bench_convergence_compression.py --seeds 0 1 2
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("none", "int8", "topk", "onebit", "onebit-zero0")
TARGETS = {"int8": 0.01, "topk": 0.03, "onebit": 0.02, "onebit-zero0": 0.02}
ONEBIT_STAGES = {"onebit": 2, "onebit-zero0": 0}  # 1-bit Adam's ZeRO stage per method name
STEPS = 300


def onebit_ds_config(out: Path, freeze_step: int, stage: int) -> Path:
    """ds_configs/zero2.json with 1-bit Adam in place of AdamW, at ZeRO `stage`."""
    config = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    config["optimizer"] = {"type": "OneBitAdam", "params": {"freeze_step": freeze_step}}
    config["zero_optimization"] = {"stage": stage} if stage != 2 else config["zero_optimization"]
    path = out / f"onebit_zero{stage}_freeze{freeze_step}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def run(out: Path, data: tuple[str, dict[str, str]], method: str, seed: int, freeze_step: int) -> float:
    """The final validation loss of one run (from its result.json when it already ran)."""
    from llmstack.net import free_port

    run_dir = out / f"{method}_seed{seed}"
    result = run_dir / "result.json"
    if result.exists():
        return json.loads(result.read_text())["val_loss"]
    if (finished := final_validation_loss(run_dir / "metrics.jsonl")) is not None:
        return finished
    tokenizer, shards = data
    ds_config = ROOT / "ds_configs" / "zero2.json"
    if method in ONEBIT_STAGES:
        ds_config = onebit_ds_config(out, freeze_step, ONEBIT_STAGES[method])
    overrides = [f"train.gradient_compression={method}"] if method in ("int8", "topk") else []
    command = [
        *(sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port())),
        *("--module", "llmstack", "train", "--config", str(ROOT / "configs" / "quickstart.yaml")),
        *("--ds-config", str(ds_config), f"data.tokenizer={tokenizer}"),
        *(f"data.train={shards['train']}", f"data.valid={shards['valid']}", f"train.out_dir={run_dir}"),
        *(f"train.max_steps={STEPS}", f"train.eval_interval={STEPS}", f"train.save_interval={10 * STEPS}"),
        *(f"train.seed={seed}", *overrides),
    ]
    print(" ".join(command), flush=True)
    with open(out / f"{method}_seed{seed}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    loss = final_validation_loss(run_dir / "metrics.jsonl")
    if loss is None:
        raise RuntimeError(f"{run_dir} has no validation loss at step {STEPS}; see {out / f'{method}_seed{seed}.log'}")
    result.write_text(json.dumps({"val_loss": loss}))
    return loss


def final_validation_loss(metrics: Path) -> float | None:
    """The validation loss at the last step from a run's metrics.jsonl; None before it is there."""
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return next((r["val_loss"] for r in records if r.get("step") == STEPS and "val_loss" in r), None)


def report(losses: dict[tuple[str, int], float], methods: list[str], seeds: list[int]) -> int:
    print(f"quickstart model and corpus, 2 ranks, fp32, ZeRO-2, {STEPS} steps; final validation loss")
    print(f"{'method':<14}" + "".join(f"{'seed ' + str(s):>11}" for s in seeds) + f"{'ratio mean':>12}{'spread':>18}")
    failed = False
    for method in methods:
        ratios = [
            losses[method, s] / losses["none", s] for s in seeds if ("none", s) in losses and (method, s) in losses
        ]
        row = f"{method:<14}" + "".join(
            f"{losses[method, s]:>11.4f}" if (method, s) in losses else f"{'-':>11}" for s in seeds
        )
        if method != "none" and ratios:
            mean = sum(ratios) / len(ratios)
            row += f"{mean:>12.4f}{f'{min(ratios):.4f}-{max(ratios):.4f}':>18}"
            within = max(ratios) - 1 <= TARGETS[method]  # a lower loss than uncompressed meets it too
            row += f"   target <= +{TARGETS[method]:.0%}: {'met' if within else 'MISSED'}"
            failed |= not within
        print(row)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/convergence_compression", help="data, runs and results")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--onebit-freeze-step", type=int, default=60)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from llmstack.cli.quickstart import prepare_data

    prepared = out / "data.json"
    if prepared.exists():
        data = tuple(json.loads(prepared.read_text()))
    else:
        data = prepare_data(str(out / "quickstart"), None, None)
        prepared.write_text(json.dumps(data))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    losses = {(m, s): run(out, data, m, s, args.onebit_freeze_step) for s in args.seeds for m in args.methods}
    for seed in args.seeds:  # the uncompressed runs another invocation made, for the ratios
        done = out / f"none_seed{seed}" / "result.json"
        if ("none", seed) not in losses and done.exists():
            losses["none", seed] = json.loads(done.read_text())["val_loss"]
    methods = [m for m in METHODS if any((m, s) in losses for s in args.seeds)]
    return report(losses, methods, args.seeds)


if __name__ == "__main__":
    sys.exit(main())
