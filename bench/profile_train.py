"""Where the time of one training step goes: torch.profiler (CPU) of bench_train.py's shape, fp32,
llmstack eager and compiled (as `train.compile: true`) and transformers' Llama, broken down into
matmuls, attention, norms, rotary, activation, loss, optimizer, inductor's fused kernels, copies
and the rest.

Every profiled op's self time goes to one category: matmul and attention kernels by name (forward
and backward); other ops by the part of the model whose code ran them (RMSNorm, rotary, MLP,
loss, optimizer; a backward op by the forward op that created it, through autograd's sequence
numbers); ops outside those parts by name (copies) or "other" (residual adds, embedding, autograd
and Python overhead). The profiler slows small ops, so the shares are what matter; the step times
without the profiler are printed beside them.

    python bench/profile_train.py [--steps 3] [--no-compile] [--trace DIR]
"""

import argparse
import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from bench_train import BATCH, SEQ, adamw, llama_step, raw_step  # bench/bench_train.py
from timing import BASELINE_MODEL  # bench/timing.py
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function
from transformers.integrations import sdpa_attention
from transformers.models.llama import modeling_llama

from llmstack import LLMStackConfig, LLMStackForCausalLM, to_llama
from llmstack.models import modeling_llmstack
from llmstack.monitor.throughput import matmul_params, measure_peak_flops
from llmstack.training.compile import compile_decoder_layers

SCOPE = "scope:"
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::_to_copy", "aten::stack"}
CATEGORIES = ["matmul", "attention", "norm", "rotary", "activation", "loss", "optimizer", "inductor fused", "copies"]


def scoped(owner: Any, attr: str, scope: str) -> None:
    """Make owner.attr run inside record_function("scope:<scope>")."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(SCOPE + scope):
            return fn(*args, **kwargs)

    setattr(owner, attr, wrapper)


def mark_model_parts() -> None:
    """Scopes around the model parts of both implementations (the compiled blocks are opaque to them)."""
    for owner, attr, scope in [
        (modeling_llmstack.RMSNorm, "forward", "norm"),
        (modeling_llmstack.RotaryEmbedding, "forward", "rotary"),
        (modeling_llmstack, "apply_rotary", "rotary"),
        (modeling_llmstack.SwiGLU, "forward", "activation"),
        (modeling_llmstack.LLMStackPreTrainedModel, "head_and_loss", "loss"),
        (modeling_llama.LlamaRMSNorm, "forward", "norm"),
        (modeling_llama.LlamaRotaryEmbedding, "forward", "rotary"),
        (modeling_llama, "apply_rotary_pos_emb", "rotary"),
        (modeling_llama.LlamaMLP, "forward", "activation"),
        (F, "scaled_dot_product_attention", "attention"),
        (sdpa_attention, "sdpa_attention_forward", "attention"),
    ]:
        scoped(owner, attr, scope)
    # transformers looks the attention function up by name at call time
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention.sdpa_attention_forward


def by_name(name: str) -> str | None:
    if name in MATMUL_OPS or name.startswith(("aten::_mkl", "mkldnn::")) or "MmBackward" in name:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if "cpp_fused" in name:
        return "inductor fused"
    return None


def breakdown(events: list[FunctionEvent]) -> dict[str, float]:
    """Self CPU microseconds per category (see the module docstring)."""
    scope_of_seq: dict[int, str] = {}
    scope_memo: dict[int, str | None] = {}

    def scope(event: FunctionEvent | None) -> str | None:
        chain = []
        found = None
        while event is not None:
            if event.id in scope_memo:
                found = scope_memo[event.id]
                break
            chain.append(event)
            if event.name.startswith(SCOPE):
                found = event.name[len(SCOPE) :]
                break
            if event.name.startswith("autograd::engine::evaluate_function"):
                found = scope_of_seq.get(event.sequence_nr)
                break
            event = event.cpu_parent
        for e in chain:
            scope_memo[e.id] = found
        return found

    ordered = sorted(events, key=lambda e: e.time_range.start)
    for event in ordered:  # forward ops first, so backward ones find their scope
        if event.sequence_nr >= 0 and not event.name.startswith("autograd::"):
            found = scope(event)
            if found is not None:
                scope_of_seq.setdefault(event.sequence_nr, found)
    totals: dict[str, float] = defaultdict(float)
    for event in ordered:
        category = by_name(event.name) or scope(event)
        if category is None:
            category = "copies" if event.name in COPY_OPS else "other"
        totals[category] += event.self_cpu_time_total
    return totals


@contextlib.contextmanager
def optimizer_scope(opt: torch.optim.Optimizer) -> Iterator[None]:
    scoped(opt, "step", "optimizer")
    scoped(opt, "zero_grad", "optimizer")
    yield


def profiled(step: Callable, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, steps: int):
    """(per-category seconds per step, profiled step seconds, unprofiled best step seconds)."""
    for _ in range(2):
        step(model, opt, batch)
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        step(model, opt, batch)
        plain.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(model, opt, batch)
        wall = (time.perf_counter() - start) / steps
    totals = breakdown(list(prof.events()))
    return {k: v / 1e6 / steps for k, v in totals.items()}, wall, min(plain), prof


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--trace", help="folder for Chrome traces of each model")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # name the fused kernels in the profile
    mark_model_parts()
    torch.manual_seed(0)
    config = LLMStackConfig(**BASELINE_MODEL)
    batch = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1))
    ours = LLMStackForCausalLM(config).train()
    llama = to_llama(ours).train()
    scoped(llama, "loss_function", "loss")  # an instance attribute from here on (transformers' setter)
    models: dict[str, tuple[Callable, torch.nn.Module]] = {
        "llmstack eager": (raw_step, ours),
        "transformers Llama": (llama_step, llama),
    }
    if not args.no_compile:
        compiled = LLMStackForCausalLM(config).train()
        compiled.load_state_dict(ours.state_dict())
        compile_decoder_layers(compiled)
        models["llmstack compiled"] = (raw_step, compiled)
    results, peaks = {}, {}
    for name, (step, model) in models.items():
        opt = adamw(model)
        with optimizer_scope(opt):
            results[name] = profiled(step, model, opt, batch, args.steps)
        peaks[name] = measure_peak_flops("cpu", seconds=1.0)
        if args.trace:
            results[name][3].export_chrome_trace(f"{args.trace}/{name.replace(' ', '_')}.json")
    names = list(results)
    print(f"batch {BATCH} x {SEQ}, fp32, {torch.get_num_threads()} threads; seconds per step (share of profiled step)")
    print(f"{'category':<16}" + "".join(f"{n:>28}" for n in names))
    for category in [*CATEGORIES, "other"]:
        cells = []
        for n in names:
            seconds = results[n][0].get(category, 0.0)
            cells.append(f"{seconds:10.4f} ({seconds / sum(results[n][0].values()):5.1%})")
        print(f"{category:<16}" + "".join(f"{c:>28}" for c in cells))
    print(f"{'profiled step':<16}" + "".join(f"{results[n][1]:10.4f}{'':>18}" for n in names))
    print(f"{'unprofiled best':<16}" + "".join(f"{results[n][2]:10.4f}{'':>18}" for n in names))
    matmul_flops = 6 * matmul_params(config) * BATCH * SEQ
    print(
        f"{'matmul / peak':<16}"
        + "".join(f"{matmul_flops / results[n][0]['matmul'] / peaks[n]:10.2f}{'':>18}" for n in names)
        + "  (6N FLOPs per token over the matmul ops' time, profiled, vs the fp32 matmul peak measured after each)"
    )


if __name__ == "__main__":
    main()
