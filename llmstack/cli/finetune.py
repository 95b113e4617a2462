"""`llmstack finetune`: supervised fine-tuning (full, LoRA or prompt tuning) on prompt/response JSONL."""

from argparse import ArgumentParser, Namespace

from llmstack.training.finetune.run import METHODS


def add_arguments(p: ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        help="run config YAML without a model section; data.train/valid are JSONL prompt/response files",
    )
    p.add_argument("--base-model", required=True, help="model directory or training checkpoint to start from")
    p.add_argument("--method", choices=METHODS, default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--num-virtual-tokens", type=int, default=16, help="soft-prompt length for --method prompt")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--response-field", default="response")
    p.add_argument("--ds-config", help="DeepSpeed JSON; overrides the run config's train.ds_config")
    p.add_argument("--resume", metavar="auto|PATH", help="continue from the newest checkpoint (auto) or a path")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="run config overrides")


def run(args: Namespace) -> None:
    from llmstack.training import load_run_config
    from llmstack.training.finetune.run import finetune
    from llmstack.training.loading import tokenizer_dir

    # The tokenizer is the base model's; the config need not name it.
    run_config = load_run_config(args.config, [f"data.tokenizer={tokenizer_dir(args.base_model)}", *args.overrides])
    out_dir = finetune(
        run_config,
        args.base_model,
        args.method,
        ds_config_path=args.ds_config,
        resume=args.resume,
        prompt_field=args.prompt_field,
        response_field=args.response_field,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        num_virtual_tokens=args.num_virtual_tokens,
    )
    print(f"wrote the fine-tuned {'adapter' if args.method != 'full' else 'model'} to {out_dir}")
