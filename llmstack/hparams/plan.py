"""The planner's arithmetic: a model's shape and parameter count, the bytes per GPU of its model
states under ZeRO 0-3 (with and without offload) and of its activations, and the layouts that fit.

Model states count what DeepSpeed's ZeRO optimizers hold at the peak of a step, per parameter:

    mixed precision (bf16/fp16): weights 2, gradients 2, and for the optimizer fp32 master 4,
        the fp32 copy of the gradient made for the step 4, Adam's two moments 8
    fp32: weights 4, gradients 4, optimizer: moments 8, and from ZeRO-1 on the fp32 partition
        (master) 4 and its step gradient 4; at ZeRO-0 torch's Adam updates the weights in place

ZeRO-1 partitions the optimizer's part over the data-parallel ranks, ZeRO-2 the gradients too,
ZeRO-3 the weights too, and then gathers one layer (weights and gradients) at a time.
Optimizer offload moves the optimizer's part and the gradients to the CPU; parameter offload
(ZeRO-3) the weights as well. This is the accounting of DeepSpeed's estimators
(estimate_zero2/3_model_states_mem_needs), except that at ZeRO-3 without offload DeepSpeed's
estimate leaves out the working-precision gradient partition buffer, which stays allocated while
the step's fp32 copy exists (deepspeed/runtime/zero/stage3.py, `grad_partitions_flat_buffer`):
that is 2 bytes per partitioned parameter (4 in fp32) more here.

Activations (per GPU, per micro-batch) are what autograd keeps for the backward of each decoder
layer of llmstack's model (SDPA attention, no attention-score matrix; RMSNorm; SwiGLU or GELU),
in elements: the two norm inputs 2sh, their outputs 2sh, q and the attention output 2sh, k and
v 2sh*kv/heads, and the MLP's hidden 4si (SwiGLU: gate, up, SiLU(gate), their product) or
2si (GELU). Tensor parallelism splits all but the norm inputs (those too with sequence
parallelism), context parallelism splits s. With 1F1B pipelining the first stage holds as many
micro-batches as there are stages, so each GPU keeps about all layers' worth of one micro-batch.
Full activation checkpointing keeps each layer's input and recomputes one layer at a time.
The loss is computed in chunks (no full logits).
"""

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmstack.errors import UserError

# GiB of memory per GPU, by name fragment (matched in this order, as llmstack.monitor.peak_flops).
GPU_MEMORY_GIB: tuple[tuple[str, float], ...] = (
    ("H200", 141.0),
    ("H100 NVL", 94.0),
    ("H100", 80.0),
    ("H20", 96.0),
    ("B200", 180.0),
    ("A100-40", 40.0),
    ("A100", 80.0),
    ("A10G", 24.0),
    ("A10", 24.0),
    ("L40S", 48.0),
    ("L4", 24.0),
    ("V100", 32.0),
    ("MI300X", 192.0),
    ("MI250X", 128.0),
)
SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
OFFLOADS = ("none", "optimizer", "optimizer+params")
HEADROOM = 0.9  # a layout fits when its estimate is at most this share of the GPU's memory (buffers, fragmentation)


def parse_count(text: str, what: str = "a count") -> float:
    """`1B`, `350M`, `20b`, `1.5T`, `7e9`, `10k` -> the number."""
    value = text.strip().replace("_", "")
    scale = SUFFIXES.get(value[-1:].lower(), 1.0) if value else 1.0
    if scale != 1.0:
        value = value[:-1]
    try:
        number = float(value) * scale
    except ValueError:
        raise UserError(
            f"{what} {text!r} must be a number, optionally with k, M, B or T (e.g. 350M, 1B, 7e9)"
        ) from None
    if not number > 0 or not math.isfinite(number):
        raise UserError(f"{what} {text!r} must be above 0")
    return number


def gpu_memory_bytes(name: str) -> float:
    for fragment, gib in GPU_MEMORY_GIB:
        if fragment.lower() in name.lower():
            return gib * 2**30
    known = ", ".join(f for f, _ in GPU_MEMORY_GIB)
    raise UserError(f"GPU {name!r} is not in the planner's table ({known}): give --gpu-memory GiB")


@dataclass(frozen=True)
class ModelShape:
    """A dense llmstack decoder's shape (LLMStackConfig's fields that size it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool = True
    gated: bool = True  # SwiGLU (three MLP matrices) or GELU (two)
    qkv_bias: bool = False

    @classmethod
    def from_model_config(cls, model: Mapping[str, Any]) -> "ModelShape":
        """From a run config's model section (LLMStackConfig's defaults for what it leaves out)."""
        from llmstack.models import LLMStackConfig

        if model.get("num_local_experts"):
            raise UserError("the planner models dense decoders; model.num_local_experts is set")
        config = LLMStackConfig(**{k: v for k, v in model.items() if k != "init_from"})
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=config.head_dim,
            tied=config.tie_word_embeddings,
            gated=config.activation == "swiglu",
            qkv_bias=bool(config.qkv_bias),
        )

    @classmethod
    def for_params(cls, params: float, vocab_size: int = 32000) -> "ModelShape":
        """A Llama-like shape of about `params` parameters: width near 128 x depth (the aspect ratio
        of Llama's 1-8B models) rounded so that tensor parallelism divides the heads, 128-wide heads
        (64 below width 1024), SwiGLU at 8/3 of the width, then the depth that gives `params`."""
        width = 128 * (params / 196608) ** (1 / 3)  # 12 L h^2 = P at h = 128 L
        granule = 1024 if width >= 4096 else 512 if width >= 2048 else 256 if width >= 1024 else 128
        hidden = max(128, granule * round(width / granule))
        head_dim = 128 if hidden >= 1024 else 64
        intermediate = 256 * max(1, round(8 * hidden / 3 / 256))
        heads = hidden // head_dim
        per_layer = 4 * hidden**2 + 3 * hidden * intermediate + 2 * hidden
        layers = max(1, round((params - vocab_size * hidden) / per_layer))
        return cls(vocab_size, hidden, intermediate, layers, heads, heads, head_dim)

    @property
    def params(self) -> int:
        """Parameters, shared (tied) ones once: what `model.parameters()` counts."""
        return (
            self.num_layers * self.layer_params
            + self.vocab_size * self.hidden_size * (1 if self.tied else 2)
            + self.hidden_size
        )

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + (3 if self.gated else 2) * h * self.intermediate_size + 2 * h

    @property
    def largest_layer_params(self) -> int:
        """The most parameters one module holds itself (DeepSpeed's `largest_layer_params`): the
        embedding, or the biggest linear layer."""
        q = self.num_heads * self.head_dim
        return max(self.vocab_size * self.hidden_size, self.hidden_size * self.intermediate_size, self.hidden_size * q)

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers, hidden {self.hidden_size}, FFN {self.intermediate_size}, "
            f"{self.num_heads} heads ({self.num_kv_heads} KV) of {self.head_dim}, vocabulary {self.vocab_size}"
            + (", tied embeddings" if self.tied else "")
        )


@dataclass(frozen=True)
class Layout:
    """How a run is spread: `gpus` in all, tensor x pipeline x context parallel, the rest data parallel."""

    gpus: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    zero_stage: int = 2
    offload: str = "none"
    activation_checkpointing: bool = False

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions over: data and context parallel ranks."""
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor * self.pipeline * self.context)

    def problem(self, shape: ModelShape) -> str | None:
        """Why this layout cannot run `shape` (None when it can)."""
        if self.gpus % (self.tensor * self.pipeline * self.context):
            sizes = f"{self.tensor}x{self.pipeline}x{self.context}"
            return f"tensor x pipeline x context ({sizes}) must divide {self.gpus} GPUs"
        if shape.num_heads % self.tensor or shape.num_kv_heads % self.tensor:
            return f"tensor {self.tensor} must divide the {shape.num_heads} heads and {shape.num_kv_heads} KV heads"
        if self.pipeline > shape.num_layers:
            return f"pipeline {self.pipeline} exceeds the {shape.num_layers} layers"
        if self.pipeline > 1 and self.zero_stage > 1:
            return "DeepSpeed's pipeline engine takes ZeRO-0 or ZeRO-1 only"
        if self.offload not in OFFLOADS or (self.offload == "optimizer+params" and self.zero_stage != 3):
            return "parameter offload needs ZeRO-3"
        if self.offload != "none" and self.zero_stage == 0:
            return "offload needs ZeRO 1-3"
        return None

    def describe(self) -> str:
        parts = [f"tp {self.tensor}", f"pp {self.pipeline}", f"cp {self.context}", f"dp {self.data_parallel}"]
        parts.append(f"ZeRO-{self.zero_stage}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.activation_checkpointing:
            parts.append("ckpt")
        return " ".join(parts)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU (and what offload puts in CPU memory, per GPU)."""

    parameters: float
    gradients: float
    optimizer_states: float  # master weights, the step's fp32 gradient copy, Adam's moments
    activations: float
    cpu: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def bytes_per_parameter(precision: str, zero_stage: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter before partitioning."""
    if precision == "fp32":
        return 4, 4, 8 + (8 if zero_stage >= 1 else 0)
    if precision in ("bf16", "fp16"):
        return 2, 2, 16
    raise UserError(f"precision must be bf16, fp16 or fp32; got {precision!r}")


def model_state_bytes(
    params: float, largest_layer: float, layout: Layout, precision: str = "bf16"
) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer states, CPU) bytes per GPU for `params` parameters (the
    whole model's: tensor and pipeline parallelism divide them)."""
    weights, grads, optimizer = bytes_per_parameter(precision, layout.zero_stage)
    local = params / (layout.tensor * layout.pipeline)
    shards = layout.zero_ranks
    stage, offload = layout.zero_stage, layout.offload
    p = weights * local / (shards if stage >= 3 else 1)
    g = grads * local / (shards if stage >= 2 else 1)
    o = optimizer * local / (shards if stage >= 1 else 1)
    cpu = 0.0
    if offload != "none":
        cpu, g, o = cpu + g + o, 0.0, 0.0
    if offload == "optimizer+params":
        cpu, p = cpu + p, 0.0
    if stage == 3:  # one layer gathered, weights and gradients
        p += weights * largest_layer / layout.tensor
        g += grads * largest_layer / layout.tensor
    return p, g, o, cpu


def activation_bytes(
    shape: ModelShape,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    sequence_parallel: bool = True,
) -> float:
    """What autograd keeps for one micro-batch per GPU (see the module docstring)."""
    element = 4 if precision == "fp32" else 2
    tokens = micro_batch * seq_len / layout.context
    h, t = shape.hidden_size, layout.tensor
    kv_share = shape.num_kv_heads / shape.num_heads
    norm_inputs = 2 * h / (t if sequence_parallel else 1)
    split = (2 * h + 2 * h + 2 * h * kv_share + (4 if shape.gated else 2) * shape.intermediate_size) / t
    layer = tokens * (norm_inputs + split)
    if layout.activation_checkpointing:
        kept = tokens * h / (t if sequence_parallel else 1)  # each layer's input
        return element * (shape.num_layers * kept + layer)
    return element * shape.num_layers * layer


def memory(
    shape: ModelShape,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    params: float | None = None,
) -> Memory:
    """The per-GPU memory of `shape` (or of `params` parameters of about that shape) under `layout`."""
    p, g, o, cpu = model_state_bytes(params or shape.params, shape.largest_layer_params, layout, precision)
    return Memory(p, g, o, activation_bytes(shape, layout, micro_batch, seq_len, precision), cpu)


def zero_layouts(base: Layout) -> Iterator[Layout]:
    """ZeRO 0-3, each without and with the offloads it takes, on `base`'s parallel sizes."""
    for stage in range(4):
        for offload in OFFLOADS:
            layout = replace(base, zero_stage=stage, offload=offload)
            if offload == "none" or (stage > 0 and (offload == "optimizer" or stage == 3)):
                yield layout


def candidate_layouts(shape: ModelShape, gpus: int, gpus_per_node: int = 8) -> Iterator[Layout]:
    """Every layout worth weighing that `llmstack train` runs: tensor parallel within a node and
    pipeline parallel in powers of two, or tensor x context parallel within a node (which `llmstack
    train` runs without pipeline parallelism), each ZeRO stage and offload, with and without
    activation checkpointing."""
    powers = [2**i for i in range(0, 12) if 2**i <= gpus]
    for tensor in [t for t in powers if t <= gpus_per_node]:
        for pipeline in powers:
            contexts = [c for c in powers if tensor * c <= gpus_per_node] if pipeline == 1 else [1]
            for context in contexts:
                for checkpointing in (False, True):
                    base = Layout(gpus, tensor, pipeline, context, activation_checkpointing=checkpointing)
                    for layout in zero_layouts(base):
                        if layout.problem(shape) is None:
                            yield layout


def training_seconds(flops: float, gpus: int, peak_flops: float, mfu: float, activation_checkpointing: bool) -> float:
    """Wall time of `flops` model FLOPs at `mfu` of the GPUs' peak; full recomputation adds a
    forward pass (8ND hardware FLOPs for 6ND model FLOPs)."""
    return flops * (8 / 6 if activation_checkpointing else 1.0) / (gpus * peak_flops * mfu)
