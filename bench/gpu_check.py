"""The GPU half of bench/gpu_check.sh (run that): throughput and MFU of a ~1B llmstack model at
sequence 4096 on one GPU, bf16 ZeRO-2 with DeepSpeed's FusedAdam and flash SDPA, activation
checkpointing off and on, and the fp16 loss-scaling path; saves the model for `llmstack generate`.

    python bench/gpu_check.py OUT_DIR [--steps 8]
"""

import argparse
import sysconfig
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmstack import LLMStackConfig, LLMStackForCausalLM
from llmstack.compat.transformers import enable_activation_checkpointing
from llmstack.data.tokenizer import train_tokenizer
from llmstack.monitor.peak_flops import resolve_peak_flops
from llmstack.monitor.throughput import flops_per_token, format_flops

SEQ = 4096
# TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 key/value heads, FFN 5632), with the
# vocabulary of a tokenizer trained here.
SHAPE = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)


def tokenizer_and_config(out: Path) -> LLMStackConfig:
    """A byte-level BPE trained on a few MB of the standard library's sources, and the model config."""
    texts = [p.read_text(errors="ignore") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:300]]
    tokenizer = train_tokenizer(texts, vocab_size=32000, out_dir=out / "model")
    return LLMStackConfig(
        vocab_size=len(tokenizer),
        intermediate_size=5632,
        max_position_embeddings=SEQ,
        eos_token_id=None,  # random weights: generation runs to --max-new-tokens
        **SHAPE,
    )


def ds_config(dtype: str, micro_batch: int) -> dict[str, Any]:
    precision = {"bf16": {"enabled": True}} if dtype == "bf16" else {"fp16": {"enabled": True, "loss_scale": 0}}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        # No "torch_adam": on CUDA DeepSpeed builds its FusedAdam (a JIT build the first time).
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "steps_per_print": 10**9,
        **precision,
    }


def train(
    config: LLMStackConfig, dtype: str, micro_batch: int, steps: int, checkpointing: bool, flash: bool
) -> dict[str, Any]:
    import deepspeed

    torch.manual_seed(0)
    model = LLMStackForCausalLM(config)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    engine, optimizer, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(dtype, micro_batch)
    )
    inner = getattr(optimizer, "optimizer", optimizer)
    batch = torch.randint(0, config.vocab_size, (micro_batch, SEQ + 1), device=engine.device)
    attention: AbstractContextManager[None] = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else nullcontext()
    losses, start = [], 0.0
    torch.cuda.reset_peak_memory_stats()
    with attention:
        for step in range(steps + 2):  # 2 warm-up steps
            if step == 2:
                torch.cuda.synchronize()
                start = time.perf_counter()
            loss = engine(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    seconds = time.perf_counter() - start
    tokens_per_s = steps * micro_batch * SEQ / seconds
    result = {
        "tokens_per_s": tokens_per_s,
        "flops": tokens_per_s * flops_per_token(config, SEQ),
        "memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "optimizer": type(inner).__name__,
        "losses": losses,
    }
    if dtype == "fp16":
        result["loss_scale"] = engine.optimizer.cur_scale if hasattr(engine.optimizer, "cur_scale") else None
        result["skipped_steps"] = engine.skipped_steps
    del engine, optimizer, model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()

    from llmstack.training.distributed import init_distributed

    init_distributed()
    name = torch.cuda.get_device_name()
    config = tokenizer_and_config(args.out)
    n_params = sum(p.numel() for p in LLMStackForCausalLM(config).parameters())
    peak = resolve_peak_flops(torch.bfloat16)
    print(f"{name}: model {n_params / 1e9:.2f}B parameters, seq {SEQ}, micro-batch {args.micro_batch}", flush=True)
    print(f"peak for MFU: {format_flops(peak.flops)} ({peak.source}: {peak.detail})", flush=True)

    flash = True
    try:
        runs = {"bf16 ZeRO-2, flash SDPA": train(config, "bf16", args.micro_batch, args.steps, False, flash=True)}
    except RuntimeError as error:  # no flash kernel for this GPU or these inputs: say so, measure the rest
        print(f"flash SDPA failed ({str(error).splitlines()[0]}); measuring with the default SDPA", flush=True)
        flash = False
        runs = {"bf16 ZeRO-2, default SDPA": train(config, "bf16", args.micro_batch, args.steps, False, flash=False)}
    runs["bf16 ZeRO-2, activation checkpointing"] = train(config, "bf16", args.micro_batch, args.steps, True, flash)
    runs["fp16 ZeRO-2 (dynamic loss scale)"] = train(
        config, "fp16", args.micro_batch, max(args.steps // 2, 2), False, flash
    )
    for label, run in runs.items():
        print(
            f"{label:40s} {run['tokens_per_s']:9.0f} tokens/s  {format_flops(run['flops'])}  "
            f"MFU {run['flops'] / peak.flops:6.1%}  peak memory {run['memory_gib']:.1f} GiB  "
            f"optimizer {run['optimizer']}  loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}"
        )
    fp16 = runs["fp16 ZeRO-2 (dynamic loss scale)"]
    print(f"fp16: loss scale {fp16['loss_scale']}, skipped steps {fp16['skipped_steps']}")
    first = next(iter(runs.values()))
    print(f"bf16 MFU {first['flops'] / peak.flops:.1%} (target >= 45% on H100/H200)")

    model = LLMStackForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out / "model")


if __name__ == "__main__":
    main()
