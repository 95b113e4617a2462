"""One layout: how a run splits its model and data over the ranks and what it trains, and the one
table of which combinations llmstack supports.

A `Layout` is built once from the run config and the ds_config (`llmstack.training.config.run_layout`)
and checked once, before any process group or model exists, by `check_layout`: every rule of
`RULES` that the layout breaks is named in one message, with its reason and the one-line way out.
Nothing else in llmstack decides which combinations work; `llmstack doctor --layouts` prints the
table and docs/parallelism.md shows it.

Each rule says why it exists:
    upstream         a library llmstack builds on refuses it (the reason names where)
    physical         the combination has no meaning (e.g. splitting the experts of a dense model)
    not implemented  it could work but llmstack does not do it yet (the reason says what is missing)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from llmstack.errors import UserError

MODEL_KINDS = ("dense", "moe", "bigbird")
OBJECTIVES = ("causal", "mlm", "contrastive", "multitask", "span_corruption")
OBJECTIVE_NAMES = {
    "causal": "causal",
    "mlm": "masked-LM",
    "contrastive": "contrastive embedding",
    "multitask": "multi-task",
    "span_corruption": "span-corruption encoder-decoder",
}
PRECISIONS = ("fp32", "bf16", "fp16")
CONTEXT_METHODS = ("ulysses", "ring")  # see llmstack.parallel.context_parallel
GRADIENT_COMPRESSION = ("none", "int8", "topk")  # see llmstack.optim.gradient_compression


@dataclass(frozen=True)
class Layout:
    """How one run is split over ranks and what it trains. Sizes multiply to the world size:
    data x tensor x pipeline x context ranks (the expert-parallel groups lie inside data)."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1  # an MoE model's experts split over this many data-parallel ranks
    context: int = 1  # each sequence split over this many ranks (context parallelism)
    context_method: str = "ulysses"  # how attention spans them: one of CONTEXT_METHODS
    data: int | None = None  # the data-parallel size, once the world size is known
    zero_stage: int = 0
    sequence_parallel: bool = False  # activations between sub-layers split over the tensor group
    precision: str = "fp32"
    compile: bool = False
    activation_checkpointing: bool = False
    tiled_mlp_tokens: int = 0  # decoder MLPs run in tiles of this many tokens (0: whole)
    # "causal" (decoder), "mlm" (masked-LM encoder), "contrastive" (embeddings), "multitask" (task
    # heads on one trunk) or "span_corruption" (T5)
    objective: str = "causal"
    momentum_queue: bool = False  # contrastive: a MoCo key encoder and queue (train.queue_size)
    model: str = "dense"  # "dense", "moe" (mixture of experts) or "bigbird" (block-sparse attention)
    streamed: bool = False  # raw documents read and tokenized while training (data.sources)
    weighted_shards: bool = False  # a weighted mixture of packed shards (data.train entries with weights)
    init_from: bool = False  # starts from a pretrained model directory
    variable_length: bool = False  # padded batches of varying shape (fine-tuning)
    document_masking: bool = False  # attention within each packed document (data.document_masking)
    onebit_adam: bool = False
    grad_clip: bool = True
    gradient_compression: str = "none"  # one of GRADIENT_COMPRESSION
    overlap_comm: bool = False  # the ds_config's zero_optimization.overlap_comm

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "expert", "context"):
            if getattr(self, name) < 1:
                raise UserError(f"train.{name}_parallel_size must be at least 1; got {getattr(self, name)}")
        for name, allowed in (("model", MODEL_KINDS), ("objective", OBJECTIVES), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"layout {name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.gradient_compression not in GRADIENT_COMPRESSION:
            methods = ", ".join(GRADIENT_COMPRESSION)
            raise UserError(f"train.gradient_compression must be one of {methods}; got {self.gradient_compression!r}")
        if self.context_method not in CONTEXT_METHODS:
            methods = ", ".join(CONTEXT_METHODS)
            raise UserError(f"train.context_parallel_method must be one of {methods}; got {self.context_method!r}")

    @property
    def overlapped_reduction(self) -> bool:
        """llmstack's gradient reduction overlapping backward (overlap_comm at ZeRO-0, which
        DeepSpeed leaves to llmstack; at stages 1-3 overlap_comm is DeepSpeed's own)."""
        return self.overlap_comm and self.zero_stage == 0

    @property
    def replaces_reduction(self) -> bool:
        """Whether llmstack, not DeepSpeed, reduces the data-parallel gradients."""
        return self.gradient_compression != "none" or self.overlapped_reduction

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context

    def describe(self) -> str:
        """One line for logs and messages, e.g. "data 2 x tensor 2, ZeRO-1, fp32, causal dense"."""
        sizes = [f"data {self.data}" if self.data is not None else "data N"]
        sizes += [f"{name} {size}" for name, size in self.sizes().items() if size > 1]
        if self.context > 1:
            sizes[-1] += f" ({self.context_method})"
        features = [f"ZeRO-{self.zero_stage}", self.precision]
        flags = {
            "sequence parallel": self.sequence_parallel,
            "compiled": self.compile,
            "activation checkpointing": self.activation_checkpointing,
            f"tiled MLP ({self.tiled_mlp_tokens} tokens)": self.tiled_mlp_tokens > 0,
            "streamed data": self.streamed,
            "init_from": self.init_from,
            "document masking": self.document_masking,
            "1-bit Adam": self.onebit_adam,
            f"{self.gradient_compression} gradients": self.gradient_compression != "none",
            "overlapped reduction": self.overlapped_reduction,
            "MoCo queue": self.momentum_queue,
        }
        features += [name for name, on in flags.items() if on]
        kind = f"{OBJECTIVE_NAMES[self.objective]} {self.model}"
        return f"{' x '.join(sizes)}, {', '.join(features)}, {kind}"

    def sizes(self) -> dict[str, int]:
        return {"tensor": self.tensor, "pipeline": self.pipeline, "expert": self.expert, "context": self.context}


@dataclass(frozen=True)
class Rule:
    """A combination llmstack refuses: `applies` says whether a layout has it."""

    name: str
    applies: Callable[[Layout], bool]
    kind: str  # "upstream", "physical" or "not implemented"
    reason: str
    way_out: str

    def message(self) -> str:
        return f"{self.name} ({self.kind}: {self.reason}); {self.way_out}"


RULES: tuple[Rule, ...] = (
    Rule(
        "pipeline parallelism with ZeRO stage 2 or 3",
        lambda lay: lay.pipeline > 1 and lay.zero_stage > 1,
        "upstream",
        "DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only",
        "use ds_configs/zero1.json with train.pipeline_parallel_size > 1",
    ),
    Rule(
        "pipeline parallelism with variable-length batches",
        lambda lay: lay.pipeline > 1 and lay.variable_length,
        "upstream",
        "DeepSpeed's pipeline engine sends activation shapes once, so every micro-batch must have one shape",
        "fine-tune with train.pipeline_parallel_size 1, or pretrain on packed blocks",
    ),
    Rule(
        "sequence parallelism without tensor parallelism",
        lambda lay: lay.sequence_parallel and lay.tensor == 1,
        "physical",
        "it splits the activations that a tensor-parallel group would otherwise replicate",
        "set train.tensor_parallel_size > 1, or train.sequence_parallel false",
    ),
    Rule(
        "sequence parallelism with pipeline parallelism",
        lambda lay: lay.sequence_parallel and lay.pipeline > 1,
        "not implemented",
        "llmstack's pipeline stages send whole sequences to each other",
        "set train.sequence_parallel false with train.pipeline_parallel_size > 1",
    ),
    Rule(
        "expert parallelism with a dense model",
        lambda lay: lay.expert > 1 and lay.model != "moe",
        "physical",
        "expert parallelism splits the experts of a mixture-of-experts model; a dense model has none",
        "set train.expert_parallel_size 1, or give the model num_local_experts",
    ),
    Rule(
        "expert and tensor parallelism with ZeRO stage 3",
        lambda lay: lay.expert > 1 and lay.tensor > 1 and lay.zero_stage == 3,
        "upstream",
        "DeepSpeed's ZeRO-3 sums the experts' gradient norm over the expert-parallel group only "
        "(stage3.py, _grad_norm_counts_every_rank): clipping misses the other tensor-parallel ranks' experts",
        "use ZeRO stage 1 or 2 (ds_configs/zero2.json) with tensor and expert parallelism",
    ),
    Rule(
        "1-bit Adam with ZeRO stage 3",
        lambda lay: lay.onebit_adam and lay.zero_stage == 3,
        "not implemented",
        "llmstack's 1-bit Adam partitions its own state at ZeRO 1/2; ZeRO-3's weights, gathered layer by layer, "
        "leave it no whole step to compress",
        "use ZeRO stage 0, 1 or 2 with 1-bit Adam (ds_configs/onebit_adam_zero2.json)",
    ),
    Rule(
        "gradient compression with ZeRO stage 3",
        lambda lay: lay.gradient_compression != "none" and lay.zero_stage == 3,
        "not implemented",
        "ZeRO-3 reduce-scatters partitioned gradients in buckets of its own, which llmstack does not replace",
        "use ZeRO stage 0, 1 or 2 (ds_configs/zero2.json) with train.gradient_compression",
    ),
    Rule(
        "gradient compression or ZeRO-0 overlap with model parallelism",
        lambda lay: lay.replaces_reduction and lay.model_parallel_size * lay.expert > 1,
        "not implemented",
        "llmstack's own reduction (compressed, or overlapping backward at ZeRO-0) replaces the plain data-parallel "
        "reduction only; pipeline, tensor, context and expert layouts reduce gradients over other groups and in "
        "other places",
        "use data parallelism alone (train.*_parallel_size 1) with train.gradient_compression or overlap_comm",
    ),
    Rule(
        "gradient compression or ZeRO-0 overlap with 1-bit Adam",
        lambda lay: lay.replaces_reduction and lay.onebit_adam,
        "physical",
        "1-bit Adam compresses the momentum itself and turns the gradient reduction off",
        "use AdamW with train.gradient_compression or overlap_comm, or 1-bit Adam without them",
    ),
    Rule(
        "gradient compression or ZeRO-0 overlap in bf16 or fp16",
        lambda lay: lay.replaces_reduction and lay.precision != "fp32",
        "not implemented",
        "DeepSpeed's bf16 optimizer reduces its own fp32 gradient copies, and fp16 overflow checks would see "
        "quantized gradients; only fp32 runs are wired and tested",
        "train in fp32 (no bf16/fp16 section in the ds_config) with train.gradient_compression or overlap_comm",
    ),
    Rule(
        "expert parallelism at ZeRO stage 0 in fp32 with gradient clipping",
        lambda lay: lay.expert > 1 and lay.zero_stage == 0 and lay.precision == "fp32" and lay.grad_clip,
        "upstream",
        "DeepSpeed clips there by the mean of the ranks' gradient norms, each missing the other ranks' experts",
        "use ZeRO stage 1 or 2 (ds_configs/zero1.json), or set train.grad_clip=0",
    ),
    Rule(
        "a masked-LM encoder with a mixture-of-experts model",
        lambda lay: lay.objective == "mlm" and lay.model == "moe",
        "not implemented",
        "mixture of experts is wired into the decoder only; the encoder's MLPs are dense",
        "train the encoder without num_local_experts",
    ),
    Rule(
        "a masked-LM encoder with a weighted mixture of packed shards",
        lambda lay: lay.objective == "mlm" and lay.weighted_shards,
        "not implemented",
        "the masking is applied to plain packed shards and to streams",
        "give the encoder's shards as plain prefixes in data.train, or stream the sources (data.sources)",
    ),
    Rule(
        "document masking with BigBird attention",
        lambda lay: lay.document_masking and lay.model == "bigbird",
        "not implemented",
        "the block-sparse kernels take no per-token document restriction yet",
        "set data.document_masking false for a model with attention_pattern bigbird, or use dense attention",
    ),
    Rule(
        "document masking with fine-tuning batches",
        lambda lay: lay.document_masking and lay.variable_length,
        "physical",
        "a fine-tuning sample is one prompt and response, padded, not packed documents",
        "set data.document_masking false for fine-tuning",
    ),
    Rule(
        "document masking with pipeline parallelism",
        lambda lay: lay.document_masking and lay.pipeline > 1,
        "not implemented",
        "llmstack's pipeline stages pass (inputs, labels) only, not the documents' positions and numbers",
        "set data.document_masking false with train.pipeline_parallel_size > 1",
    ),
    Rule(
        "context parallelism with pipeline parallelism",
        lambda lay: lay.context > 1 and lay.pipeline > 1,
        "not implemented",
        "llmstack's pipeline stages pass whole sequences, not a rank's chunks with their positions",
        "set train.context_parallel_size 1 with train.pipeline_parallel_size > 1",
    ),
    Rule(
        "context parallelism with a mixture-of-experts model",
        lambda lay: lay.context > 1 and lay.model == "moe",
        "not implemented",
        "the router's load-balancing loss is a mean over each rank's tokens, not over the whole sequence",
        "set train.context_parallel_size 1 for a model with num_local_experts",
    ),
    Rule(
        "context parallelism with BigBird attention",
        lambda lay: lay.context > 1 and lay.model == "bigbird",
        "not implemented",
        "the block-sparse kernels read the whole sequence's keys on one rank",
        "use dense attention with train.context_parallel_size > 1",
    ),
    Rule(
        "context parallelism with a masked-LM encoder",
        lambda lay: lay.context > 1 and lay.objective == "mlm",
        "not implemented",
        "the split attention is causal, and the encoder's targets are not shifted before the split",
        "set train.context_parallel_size 1 for train.objective mlm",
    ),
    Rule(
        "context parallelism with fine-tuning batches",
        lambda lay: lay.context > 1 and lay.variable_length,
        "not implemented",
        "the split attention takes no padding mask, and labels shifted inside the model would lose the "
        "target at each chunk's end",
        "fine-tune with train.context_parallel_size 1",
    ),
    Rule(
        "context parallelism with sequence parallelism",
        lambda lay: lay.context > 1 and lay.sequence_parallel,
        "not implemented",
        "sequence parallelism splits the sequence again over the tensor ranks, with positions of its own",
        "set train.sequence_parallel false with train.context_parallel_size > 1",
    ),
    Rule(
        "context parallelism compiled",
        lambda lay: lay.context > 1 and lay.compile,
        "not implemented",
        "the split attention communicates inside each decoder block, which llmstack compiles whole",
        "set train.compile false (auto leaves a context-parallel run eager)",
    ),
    Rule(
        "tiled MLP with ZeRO stage 3",
        lambda lay: lay.tiled_mlp_tokens > 0 and lay.zero_stage == 3,
        "not implemented",
        "the tiles' weight gradients are summed over whole weights, which ZeRO-3 holds gathered only inside "
        "each linear layer's own call",
        "use ZeRO stage 0-2 (ds_configs/zero2.json) with train.tiled_mlp_tokens, or set it 0",
    ),
    Rule(
        "tiled MLP with a mixture-of-experts model",
        lambda lay: lay.tiled_mlp_tokens > 0 and lay.model == "moe",
        "not implemented",
        "an MoE layer routes and caps its experts' tokens over the whole layer input, not tile by tile",
        "set train.tiled_mlp_tokens 0 for a model with num_local_experts",
    ),
    Rule(
        "tiled MLP with tensor or pipeline parallelism",
        lambda lay: lay.tiled_mlp_tokens > 0 and (lay.tensor > 1 or lay.pipeline > 1),
        "not implemented",
        "tiles of a split MLP (collectives inside each tile, a pipeline's stages) are not yet checked against "
        "one process",
        "set train.tiled_mlp_tokens 0 with tensor or pipeline parallelism",
    ),
    Rule(
        "tiled MLP compiled",
        lambda lay: lay.tiled_mlp_tokens > 0 and lay.compile,
        "not implemented",
        "the tiles' loop and recomputing backward are not checked under torch.compile",
        "set train.compile false (auto leaves a tiled-MLP run eager)",
    ),
    Rule(
        "a contrastive embedding model with tensor parallelism",
        lambda lay: lay.objective == "contrastive" and lay.tensor > 1,
        "not implemented",
        "the pooling and the in-batch negatives are gathered over data-parallel ranks only, not checked "
        "with hidden states split over tensor ranks",
        "train embeddings with data parallelism and ZeRO (ds_configs/zero2.json): train.tensor_parallel_size 1",
    ),
    Rule(
        "a contrastive embedding model with pipeline parallelism",
        lambda lay: lay.objective == "contrastive" and lay.pipeline > 1,
        "not implemented",
        "llmstack's pipeline stages end in a token loss; InfoNCE needs the whole batch's pooled embeddings",
        "train embeddings with data parallelism and ZeRO (ds_configs/zero2.json): train.pipeline_parallel_size 1",
    ),
    Rule(
        "a contrastive embedding model with context parallelism",
        lambda lay: lay.objective == "contrastive" and lay.context > 1,
        "not implemented",
        "pooling needs every token of a text; the split attention takes no padding mask",
        "train embeddings with data parallelism and ZeRO (ds_configs/zero2.json): train.context_parallel_size 1",
    ),
    Rule(
        "a contrastive embedding model with a mixture-of-experts model",
        lambda lay: lay.objective == "contrastive" and lay.model == "moe",
        "not implemented",
        "the embedding model's trunk is dense (expert parallelism needs experts)",
        "train the embedding model without num_local_experts (and train.expert_parallel_size 1)",
    ),
    Rule(
        "a contrastive embedding model with BigBird attention",
        lambda lay: lay.objective == "contrastive" and lay.model == "bigbird",
        "not implemented",
        "the block-sparse kernels are not yet checked on padded batches of texts against one process",
        "use dense attention for train.objective contrastive",
    ),
    Rule(
        "a contrastive embedding model with token data",
        lambda lay: lay.objective == "contrastive" and (lay.streamed or lay.weighted_shards or lay.document_masking),
        "physical",
        "it trains on JSONL (query, positive) pairs or texts, not on packed or streamed documents",
        "give data.train as JSONL files of {query, positive} (or {text}) records, without data.sources, "
        "weights or data.document_masking",
    ),
    Rule(
        "a contrastive embedding model from init_from",
        lambda lay: lay.objective == "contrastive" and lay.init_from,
        "not implemented",
        "init_from loads a whole decoder or encoder with its head; the embedding model has no head",
        "start the embedding model from scratch (model section without init_from)",
    ),
    Rule(
        "a contrastive embedding model compiled at ZeRO stage 2",
        lambda lay: lay.objective == "contrastive" and lay.compile and lay.zero_stage == 2,
        "not implemented",
        "on 2 ranks its losses left one process's by 7e-2 within 6 steps (eager, and compiled at ZeRO "
        "stages 0, 1 and 3, agree to 1e-5); the cause is not found yet",
        "set train.compile false for train.objective contrastive at ZeRO stage 2, or use another stage",
    ),
    Rule(
        "a multi-task model with tensor, pipeline or context parallelism",
        lambda lay: lay.objective == "multitask" and lay.model_parallel_size > 1,
        "not implemented",
        "the task heads and the per-task losses are checked under data parallelism only; a pipeline's "
        "stages end in one token loss, and the classification heads' pooling needs every token of a text",
        "train several tasks with data parallelism and ZeRO 0-3 (ds_configs/zero2.json): tensor, pipeline "
        "and context parallel sizes 1",
    ),
    Rule(
        "a multi-task model with a mixture-of-experts or BigBird model",
        lambda lay: lay.objective == "multitask" and lay.model != "dense",
        "not implemented",
        "the multi-task trunk is dense, with dense attention over padded texts",
        "train the multi-task model without num_local_experts and with attention_pattern dense",
    ),
    Rule(
        "a multi-task model with streamed, weighted or document-masked data",
        lambda lay: lay.objective == "multitask" and (lay.streamed or lay.weighted_shards or lay.document_masking),
        "not implemented",
        "each task reads its own data (train.tasks[].data): packed shards or labelled JSONL, one sample "
        "of each task per sample of the step",
        "give each task's data in train.tasks, with no data.train, data.sources or data.document_masking",
    ),
    Rule(
        "a multi-task model from init_from",
        lambda lay: lay.objective == "multitask" and lay.init_from,
        "not implemented",
        "init_from loads a whole decoder or encoder with its head; the task heads are not loaded yet",
        "start the multi-task model from scratch (model section without init_from)",
    ),
    Rule(
        "a multi-task model compiled",
        lambda lay: lay.objective == "multitask" and lay.compile,
        "not implemented",
        "the trunk runs once a task in each forward pass, on batches of different shapes, which is not "
        "checked under torch.compile",
        "set train.compile false (auto leaves a multi-task run eager)",
    ),
    Rule(
        "a span-corruption encoder-decoder with tensor, pipeline or context parallelism",
        lambda lay: lay.objective == "span_corruption" and lay.model_parallel_size > 1,
        "not implemented",
        "llmstack's tensor plans, pipeline stages and split attention are written for the decoder-only "
        "blocks; the encoder-decoder's cross attention and relative position bias have none",
        "train the encoder-decoder with data parallelism and ZeRO 0-3 (ds_configs/zero2.json)",
    ),
    Rule(
        "a span-corruption encoder-decoder with a mixture-of-experts model or BigBird attention",
        lambda lay: lay.objective == "span_corruption" and lay.model != "dense",
        "not implemented",
        "the encoder-decoder is T5 v1.1's dense layout, which the stock T5 export must match",
        "train the encoder-decoder without num_local_experts and with attention_pattern dense",
    ),
    Rule(
        "a span-corruption encoder-decoder with streamed, weighted or document-masked data",
        lambda lay: (
            lay.objective == "span_corruption" and (lay.streamed or lay.weighted_shards or lay.document_masking)
        ),
        "not implemented",
        "the span corruption is applied to plain packed shards only",
        "give data.train as plain packed prefixes, without data.sources, weights or data.document_masking",
    ),
    Rule(
        "a span-corruption encoder-decoder from init_from",
        lambda lay: lay.objective == "span_corruption" and lay.init_from,
        "not implemented",
        "init_from loads decoders and encoders; loading an encoder-decoder is not wired yet",
        "start the encoder-decoder from scratch (model section without init_from)",
    ),
    Rule(
        "a span-corruption encoder-decoder compiled or with tiled MLPs",
        lambda lay: lay.objective == "span_corruption" and (lay.compile or lay.tiled_mlp_tokens > 0),
        "not implemented",
        "both rewrite the decoder-only blocks; the encoder-decoder's blocks are not yet checked under them",
        "set train.compile false and train.tiled_mlp_tokens 0",
    ),
    Rule(
        "a MoCo queue with ZeRO stage 3",
        lambda lay: lay.momentum_queue and lay.zero_stage == 3,
        "not implemented",
        "the momentum encoder follows the whole parameters, which ZeRO-3 partitions",
        "use ZeRO stage 0-2 (ds_configs/zero2.json) with train.queue_size > 0, or set train.queue_size 0",
    ),
)


def check_context_heads(heads: int, size: int, method: str, tensor_parallel_size: int = 1) -> None:
    """Raise UserError unless `method` can split attention of `heads` heads, of which each
    tensor-parallel rank holds 1/`tensor_parallel_size`, over `size` context-parallel ranks:
    Ulysses gives each context rank whole heads of its tensor-parallel rank; ring takes any count."""
    per_rank = heads // tensor_parallel_size
    if method == "ulysses" and per_rank % size:
        raise UserError(
            f"train.context_parallel_size ({size}) must divide the attention heads per tensor-parallel rank "
            f"({per_rank}) for Ulysses attention, which gives each rank whole heads; set "
            "train.context_parallel_method ring (any head count), or another size"
        )


def refusals(layout: Layout, rules: Iterable[Rule] = RULES) -> list[Rule]:
    """The rules `layout` breaks (none: llmstack supports it)."""
    return [rule for rule in rules if rule.applies(layout)]


def check_layout(layout: Layout, source: str = "run config") -> None:
    """Raise one UserError naming every rule `layout` breaks, each with its reason and way out."""
    broken = refusals(layout)
    if len(broken) == 1:
        raise UserError(f"{source}: this layout cannot run: {broken[0].message()}")
    if broken:
        listed = "".join(f"\n  - {rule.message()}" for rule in broken)
        raise UserError(f"{source}: this layout cannot run, for {len(broken)} reasons:{listed}")


# The 2-rank layouts and model kinds of the supported-combinations table, and the features each
# cell is also checked with.
TWO_RANK_LAYOUTS: dict[str, Layout] = {
    "data 2, ZeRO-0": Layout(zero_stage=0),
    "data 2, ZeRO-1": Layout(zero_stage=1),
    "data 2, ZeRO-2": Layout(zero_stage=2),
    "data 2, ZeRO-3": Layout(zero_stage=3),
    "tensor 2, ZeRO-1": Layout(tensor=2, zero_stage=1),
    "tensor 2 + sequence parallel": Layout(tensor=2, zero_stage=1, sequence_parallel=True),
    "pipeline 2, ZeRO-1": Layout(pipeline=2, zero_stage=1),
    "expert 2, ZeRO-2": Layout(expert=2, zero_stage=2),
    "expert 2, ZeRO-3": Layout(expert=2, zero_stage=3),
    "context 2, ZeRO-1": Layout(context=2, zero_stage=1),
    "context 2 (ring), ZeRO-3": Layout(context=2, context_method="ring", zero_stage=3),
}
MODEL_COLUMNS: dict[str, dict[str, str]] = {
    "dense": {"model": "dense"},
    "MoE": {"model": "moe"},
    "masked LM": {"objective": "mlm"},
    "contrastive": {"objective": "contrastive"},
    "multi-task": {"objective": "multitask"},
    "span corruption": {"objective": "span_corruption"},
    "BigBird": {"model": "bigbird"},
}
FEATURES: dict[str, dict[str, object]] = {
    "compile": {"compile": True},
    "activation checkpointing": {"activation_checkpointing": True},
    "bf16": {"precision": "bf16"},
    "streamed data": {"streamed": True},
    "init_from": {"init_from": True},
    "document masking": {"document_masking": True},
}


def cell(layout: Layout, model: str, feature: str | None = None) -> Layout:
    """`layout` training the model kind `model` (a MODEL_COLUMNS key), with `feature` on."""
    changes: dict[str, object] = {**MODEL_COLUMNS[model], **(FEATURES[feature] if feature else {})}
    return dataclasses.replace(layout, data=2 // layout.model_parallel_size, **changes)  # type: ignore[arg-type]


def supported_cells() -> list[tuple[str, str, str | None]]:
    """Every (2-rank layout, model kind, feature or None) cell of the table that llmstack supports."""
    cells: list[tuple[str, str, str | None]] = []
    for name, layout in TWO_RANK_LAYOUTS.items():
        for model in MODEL_COLUMNS:
            for feature in (None, *FEATURES):
                if not refusals(cell(layout, model, feature)):
                    cells.append((name, model, feature))
    return cells


def table_rows() -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the 2-rank table: "yes", "yes except <features>", or "no (<rule numbers>)"."""
    numbers = {rule.name: i + 1 for i, rule in enumerate(RULES)}
    header = ["2 ranks", *MODEL_COLUMNS]
    rows = []
    for name, layout in TWO_RANK_LAYOUTS.items():
        row = [name]
        for model in MODEL_COLUMNS:
            broken = refusals(cell(layout, model))
            if broken:
                row.append("no (" + ", ".join(str(numbers[r.name]) for r in broken) + ")")
                continue
            missing = [f for f in FEATURES if refusals(cell(layout, model, f))]
            row.append("yes" if not missing else "yes, not " + " / ".join(missing))
        rows.append(row)
    return header, rows


def format_table(markdown: bool = False) -> str:
    """The supported-combinations table and the numbered rules, as text or Markdown."""
    header, rows = table_rows()
    lines = _markdown(header, rows) if markdown else _aligned(header, rows)
    lines += ["", f"Features checked in every cell: {', '.join(FEATURES)}.", "", "Refused combinations:"]
    for i, rule in enumerate(RULES, 1):
        lines.append(f"{i}. {rule.name} [{rule.kind}]: {rule.reason}. Way out: {rule.way_out}.")
    return "\n".join(lines)


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(value.ljust(w) for value, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
