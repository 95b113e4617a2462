import os
from argparse import ArgumentParser, Namespace

from llmstack.training import Trainer, load_run_config
from llmstack.training.distributed import shutdown_distributed


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


def run(args: Namespace) -> int:
    run_config = load_run_config(args.config, args.overrides)
    # Under `accelerate launch` with its DeepSpeed plugin, the plugin's JSON is the ds_config.
    ds_config = args.ds_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    trainer = Trainer(run_config, ds_config_path=ds_config)
    if args.resume:
        trainer.resume(args.resume, trust=args.trust_checkpoint)
    trainer.train()
    shutdown_distributed()
    # Preempted: the checkpoint is saved; exit as the signal would have, so schedulers requeue.
    return 128 + trainer.stopped_by if trainer.stopped_by else 0
