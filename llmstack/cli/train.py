import os

from llmstack.training import Trainer, load_run_config


def add_arguments(p):
    p.add_argument("--config", required=True, help="run config YAML (configs/NAME.yaml)")
    p.add_argument("--ds-config", help="DeepSpeed JSON; overrides the run config's train.ds_config")
    p.add_argument("--resume", metavar="auto|PATH", help="continue from the newest checkpoint (auto) or a path")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="run config overrides")


def run(args):
    run_config = load_run_config(args.config, args.overrides)
    # Under `accelerate launch` with its DeepSpeed plugin, the plugin's JSON is the ds_config.
    ds_config = args.ds_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    trainer = Trainer(run_config, ds_config_path=ds_config)
    if args.resume:
        trainer.resume(args.resume)
    trainer.train()
