"""`llmstack plan`: compute-optimal size and tokens, learning rate and batch, memory per GPU, time."""

import os
from argparse import ArgumentParser, Namespace
from dataclasses import dataclass

from llmstack.cli.output import result_stdout
from llmstack.errors import UserError
from llmstack.hparams import scaling_laws as laws
from llmstack.hparams.plan import (
    HEADROOM,
    Layout,
    ModelShape,
    candidate_layouts,
    gpu_memory_bytes,
    memory,
    parse_count,
    training_seconds,
    zero_layouts,
)
from llmstack.monitor.peak_flops import table_peak_flops

GIB = 2**30


def add_arguments(p: ArgumentParser) -> None:
    size = p.add_argument_group("what to train (one of --params, --config, --budget-flops)")
    size.add_argument("--params", help="parameters, e.g. 350M, 1B, 7e9")
    size.add_argument("--config", help="run config YAML: the model's shape, sequence, batch, parallel sizes, ds_config")
    size.add_argument("--tokens", help="training tokens, e.g. 20B (default: Chinchilla's 20 per parameter)")
    size.add_argument("--budget-flops", type=float, help="compute budget in FLOPs, e.g. 1e21 (C = 6ND)")
    size.add_argument("--vocab", type=int, default=32000, help="vocabulary with --params (default 32000)")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    hw.add_argument("--gpu", default="h100", help="GPU model for memory and peak FLOP/s (default h100)")
    hw.add_argument("--gpu-memory", type=float, help="GiB per GPU (default: the GPU table's)")
    hw.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s per GPU (default: the GPU table's)")
    hw.add_argument("--gpus-per-node", type=int, default=8, help="tensor parallelism stays within a node (default 8)")
    hw.add_argument(
        "--mfu", type=float, default=0.4, help="model FLOPs utilization for the time estimate (default 0.4)"
    )
    run = p.add_argument_group("run (defaults: the --config's, else these)")
    run.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="default bf16")
    run.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096)")
    run.add_argument("--micro-batch", type=int, help="sequences per GPU per micro-step (default 1)")
    run.add_argument("--tp", type=int, help="tensor-parallel size of the memory table (default 1)")
    run.add_argument("--pp", type=int, help="pipeline-parallel size of the memory table (default 1)")
    run.add_argument("--cp", type=int, default=1, help="context-parallel size of the memory table (default 1)")
    run.add_argument("--activation-checkpointing", action="store_true", default=None, help="in the memory table")
    p.add_argument("--top", type=int, default=10, help="fitting layouts to list, fastest first (default 10)")


@dataclass
class RunShape:
    """What the plan sizes: the model, its parameter count, and the run's settings."""

    shape: ModelShape
    params: float
    precision: str
    seq_len: int
    micro_batch: int
    layout: Layout
    source: str


def run_shape(args: Namespace) -> RunShape:
    given = [name for name in ("params", "config") if getattr(args, name)]
    if len(given) > 1:
        raise UserError("give --params or --config, not both")
    if args.config:
        return config_shape(args)
    if args.params:
        params = parse_count(args.params, "--params")
    elif args.budget_flops:
        params = laws.compute_optimal(args.budget_flops)[0]
    else:
        raise UserError("give --params N, --config RUN.yaml or --budget-flops C")
    shape = ModelShape.for_params(params, args.vocab)
    layout = Layout(args.gpus, args.tp or 1, args.pp or 1, args.cp, 2, "none", bool(args.activation_checkpointing))
    precision, seq_len, micro = args.precision or "bf16", args.seq_len or 4096, args.micro_batch or 1
    return RunShape(shape, params, precision, seq_len, micro, layout, f"a Llama-like shape of {_count(params)}")


def config_shape(args: Namespace) -> RunShape:
    from llmstack.training.config import load_run_config
    from llmstack.training.ds_config import load_ds_config, zero_stage

    run = load_run_config(args.config)
    model = dict(run.model)
    if "init_from" in model:
        from llmstack.models.pretrained import pretrained_config

        model = pretrained_config(str(model["init_from"])).to_dict()
    elif "vocab_size" not in model and run.data.tokenizer and os.path.isdir(run.data.tokenizer):
        from llmstack.data.tokenizer import load_tokenizer

        model["vocab_size"] = len(load_tokenizer(run.data.tokenizer))  # as the trainer sizes it
    shape = ModelShape.from_model_config(model)
    ds_config = load_ds_config(run.train.ds_config)
    precision = next((p for p in ("bf16", "fp16") if (ds_config.get(p) or {}).get("enabled")), "fp32")
    zero = ds_config.get("zero_optimization") or {}
    offload = "none"
    if (zero.get("offload_optimizer") or {}).get("device", "none") != "none":
        offload = (
            "optimizer+params" if (zero.get("offload_param") or {}).get("device", "none") != "none" else "optimizer"
        )
    train = run.train
    checkpointing = train.activation_checkpointing if args.activation_checkpointing is None else True
    layout = Layout(
        args.gpus,
        args.tp or train.tensor_parallel_size,
        args.pp or train.pipeline_parallel_size,
        args.cp,
        zero_stage(ds_config),
        offload,
        checkpointing,
    )
    return RunShape(
        shape,
        shape.params,
        args.precision or precision,
        args.seq_len or run.data.seq_len,
        args.micro_batch or train.micro_batch_size,
        layout,
        f"{args.config} ({train.ds_config}: ZeRO-{layout.zero_stage}, {precision}, offload {offload})",
    )


def run(args: Namespace) -> int:
    with result_stdout():  # DeepSpeed logs its accelerator on import: to stderr, stdout keeps the plan
        from llmstack.compat.deepspeed import zero_model_states_estimate
    if args.gpus < 1 or not 0 < args.mfu <= 1:
        raise UserError("--gpus must be at least 1 and --mfu between 0 and 1")
    plan = run_shape(args)
    gpu_bytes = args.gpu_memory * GIB if args.gpu_memory else gpu_memory_bytes(args.gpu)
    peak_key = "tf32" if plan.precision == "fp32" else plan.precision
    peak = args.peak_tflops * 1e12 if args.peak_tflops else table_peak_flops(args.gpu, peak_key)
    if not peak:
        raise UserError(f"no {peak_key} peak for GPU {args.gpu!r} in the table: give --peak-tflops")
    params, shape = plan.params, plan.shape
    if args.tokens:
        tokens = parse_count(args.tokens, "--tokens")
    elif args.budget_flops:
        tokens = args.budget_flops / (6 * params)
    else:
        tokens = laws.TOKENS_PER_PARAMETER * params
    flops = laws.training_flops(params, tokens)
    optimal_params, optimal_tokens = laws.compute_optimal(flops)
    compute = laws.deepseek_flops_per_token(shape.num_layers, shape.hidden_size, plan.seq_len) * tokens
    batch_tokens = laws.deepseek_batch_tokens(compute)

    print(f"model: {_count(params)} parameters, {shape.describe()} ({plan.source})")
    print(f"tokens: {_count(tokens)} ({tokens / params:.1f} per parameter); compute C = 6ND = {flops:.3g} FLOPs")
    print(
        f"compute-optimal for C (Chinchilla, ~20 tokens/parameter): {_count(optimal_params)} parameters "
        f"on {_count(optimal_tokens)} tokens"
    )
    print(
        f"learning rate and batch (DeepSeek LLM 2024 fit, C = M*D = {compute:.3g}): peak lr "
        f"{laws.deepseek_learning_rate(compute):.3g}, global batch {_count(batch_tokens)} tokens "
        f"= {max(1, round(batch_tokens / plan.seq_len))} sequences of {plan.seq_len}"
    )
    print()
    base = plan.layout
    print(
        f"memory per GPU, GiB ({plan.precision}, micro-batch {plan.micro_batch} x {plan.seq_len}, {args.gpus} x "
        f"{args.gpu} of {gpu_bytes / GIB:.0f} GiB; tp {base.tensor} pp {base.pipeline} cp {base.context}"
        f"{', activation checkpointing' if base.activation_checkpointing else ''}):"
    )
    header = ("layout", "params", "grads", "optimizer", "activations", "total", "CPU", "DeepSpeed", "fits")
    rows: list[tuple[str, ...]] = [header]
    for layout in zero_layouts(base):
        problem = layout.problem(shape)
        if problem:
            rows.append((_zero_name(layout), *["-"] * 7, problem))
            continue
        m = memory(shape, layout, plan.micro_batch, plan.seq_len, plan.precision, params)
        fits = "yes" if m.total <= HEADROOM * gpu_bytes else "no"
        values = (m.parameters, m.gradients, m.optimizer_states, m.activations, m.total, m.cpu)
        local = round(params / (layout.tensor * layout.pipeline))
        theirs = zero_model_states_estimate(
            layout.zero_stage, local, shape.largest_layer_params // layout.tensor, layout.zero_ranks, layout.offload
        )
        estimate = "-" if theirs is None or plan.precision == "fp32" else f"{theirs / GIB:.2f}"
        rows.append((_zero_name(layout), *(f"{v / GIB:.2f}" for v in values), estimate, fits))
    print(_table(rows))
    print(
        "  (DeepSpeed: its own estimate of the model states, mixed precision, ZeRO-2/3; at ZeRO-3 it leaves out "
        "the 16-bit gradient partition)"
    )
    print()
    rows = []
    fitting: list[tuple[float, bool, int, int, float, Layout]] = []
    for layout in candidate_layouts(shape, args.gpus, args.gpus_per_node):
        m = memory(shape, layout, plan.micro_batch, plan.seq_len, plan.precision, params)
        if m.total <= HEADROOM * gpu_bytes:
            seconds = training_seconds(flops, args.gpus, peak, args.mfu, layout.activation_checkpointing)
            parallel = layout.tensor * layout.pipeline * layout.context
            fitting.append((seconds, layout.offload != "none", parallel, layout.zero_stage, m.total, layout))
    fitting.sort(key=lambda f: f[:5])  # equal times: no offload, less model parallelism, lower ZeRO stage first
    print(
        f"layouts that fit ({len(fitting)}; within {HEADROOM:.0%} of the GPU's memory), fastest first, at "
        f"{args.mfu:.0%} MFU of {peak / 1e12:.0f} TFLOP/s ({peak_key} dense):"
    )
    rows.append(("layout", "memory GiB", "time"))
    rows += [(layout.describe(), f"{total / GIB:.1f}", _duration(s)) for s, *_, total, layout in fitting[: args.top]]
    print(_table(rows) if fitting else "  none: more GPUs, a smaller micro-batch or a GPU with more memory")
    return 0


def _count(n: float) -> str:
    """4.5M, 1B, 20B, 1.2T."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _zero_name(layout: Layout) -> str:
    return f"ZeRO-{layout.zero_stage}" + (f" offload {layout.offload}" if layout.offload != "none" else "")


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
