import os
import sys
from argparse import ArgumentParser, Namespace

from llmstack.errors import UserError
from llmstack.training import Trainer, load_run_config
from llmstack.training.checkpoint.files import read_latest
from llmstack.training.config import RunConfig
from llmstack.training.distributed import peer_failures_reported, shutdown_distributed


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run config YAML (configs/NAME.yaml)")
    p.add_argument("--ds-config", help="DeepSpeed JSON; overrides the run config's train.ds_config")
    p.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue from the newest usable checkpoint of this run (auto; a fresh start when there "
        "is none) or from a checkpoint path",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="accept a checkpoint without an llmstack manifest (e.g. one written elsewhere)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="run config overrides")


def check_fresh_start(run_config: RunConfig) -> None:
    """A run started without --resume must not write into an earlier run's directory: its
    checkpoints and metrics would interleave with this run's (and `latest` would point at either)."""
    checkpoints = os.path.join(run_config.train.out_dir, "checkpoints")
    tag = read_latest(checkpoints)
    if tag is not None:
        raise UserError(
            f"{checkpoints} holds an earlier run's checkpoints (latest: {tag}): continue that run with "
            "--resume auto, or start this one in another train.out_dir (or remove that directory)"
        )


def run(args: Namespace) -> int:
    run_config = load_run_config(args.config, args.overrides)
    if not args.resume:
        check_fresh_start(run_config)
    # Under `accelerate launch` with its DeepSpeed plugin, the plugin's JSON is the ds_config.
    ds_config = args.ds_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    with peer_failures_reported():
        trainer = Trainer(run_config, ds_config_path=ds_config)
        if args.resume:
            trainer.resume(args.resume, trust=args.trust_checkpoint)
            if trainer.step >= run_config.train.max_steps and trainer.rank == 0:
                print(
                    f"llmstack train: resumed at step {trainer.step}, the run's train.max_steps: nothing left to "
                    "train (raise train.max_steps to go on)",
                    file=sys.stderr,
                )
        trainer.train()
        shutdown_distributed()
    # Preempted: the checkpoint is saved; exit as the signal would have, so schedulers requeue.
    return 128 + trainer.stopped_by if trainer.stopped_by else 0
