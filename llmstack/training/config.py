"""The run config: one YAML file naming the model, the data, the schedule and the DeepSpeed JSON.

    model:    LLMStackConfig fields (vocab_size defaults to the tokenizer's size), or
              init_from: a pretrained model directory (llmstack, Llama, Mistral or Qwen2) whose
              config and weights the run starts from (then only dropouts and loss options may be set)
    data:     tokenizer directory (default: init_from's), packed train/valid shards, sequence length
    train:    batch sizes, optimizer, schedule, intervals, output directory, ds_config
    monitor:  console, tensorboard and wandb sinks (see MetricsLogger.from_config)

Every key is checked: an unknown one is an error naming it and the valid keys. Command-line
overrides `section.key=value` are parsed as YAML values (`train.lr=3e-4`, `data.train=[a,b]`).
"""

import dataclasses
import inspect
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from llmstack.errors import UserError
from llmstack.models import LLMStackConfig, LLMStackT5Config
from llmstack.parallel.layout import OBJECTIVES, Layout, check_context_heads


@dataclass
class DataConfig:
    tokenizer: str | None = None  # required unless model.init_from brings one
    # packed shard prefixes (llmstack data pack), or a mixture of them: [{name, prefixes, weight}]
    train: list = field(default_factory=list)
    sources: list = field(default_factory=list)  # or raw documents: [{name, paths, weight, text_field, text_unit}]
    weight_by: str = "tokens"  # a mixture weight is a share of tokens, or (documents) of documents
    # mixture weights by training step: {interpolation: linear|step, points: [{step, weights: {name: w}}]}
    schedule: dict = field(default_factory=dict)
    valid: list = field(default_factory=list)
    seq_len: int = 256
    seed: int = 1234
    prefetch: int = 2  # micro-batches a background thread reads ahead of training (0: read on demand)
    mlm_probability: float = 0.15  # train.objective mlm: share of tokens selected for the loss
    # train.objective span_corruption (llmstack.data.span_corruption): T5's share of noise tokens
    # and their mean span length
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    # attention stays inside each packed document and RoPE positions restart at each (README: Long
    # context); off unless set, so configs written before it train as they did
    document_masking: bool = False


@dataclass
class TrainConfig:
    objective: str = "causal"  # one of OBJECTIVES
    # train.objective contrastive (README: Embedding models): data.train/valid are JSONL pairs
    pooling: str = "mean"  # mean over the text's tokens, or its last token
    temperature: float = 0.05  # InfoNCE's softmax temperature
    queue_size: int = 0  # MoCo: keys of earlier batches kept as negatives (0: in-batch negatives only)
    momentum: float = 0.999  # MoCo: the key encoder's momentum
    # train.objective multitask (README: Multi-task training): [{name, kind, data, num_labels, weight}]
    tasks: list = field(default_factory=list)
    task_weighting: str = "fixed"  # fixed, uncertainty or dwa (llmstack.training.multitask)
    dwa_temperature: float = 2.0  # dwa: the softmax temperature over the tasks' loss ratios
    out_dir: str = "runs/default"
    ds_config: str = "ds_configs/zero2.json"
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    global_batch_size: int | None = None  # optional check: must equal micro * accum * data-parallel size
    max_steps: int = 1000
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    # gradients averaged compressed (README: When to compress gradients): none, int8 or topk, with
    # the share of elements top-k sends; or the ds_config's "gradient_compression" entry
    gradient_compression: str = "none"
    gradient_compression_topk: float = 0.01
    # topk: the first steps are averaged uncompressed, top-k starts after them; AdamW takes each
    # element's delayed burst as the steps' energy it carries (llmstack.optim.BurstAdamW)
    gradient_compression_warmup_steps: int = 100
    gradient_compression_normalize_bursts: bool = True
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_samples: int = 256
    save_interval: int = 500
    # checkpoints and faults (see llmstack.training.checkpoint.manager and .faults)
    save_interval_minutes: float = 0.0  # also save when this much wall-clock time has passed; 0: off
    keep_last: int = 3  # keep the newest K checkpoints (0: all) ...
    keep_every: int = 0  # ... and, forever, those whose step is a multiple of this (0: none)
    async_save: bool = False  # training waits only for the in-memory copy; a thread writes the files
    save_retries: int = 0  # retries of a failed (synchronous) save before the run stops
    save_retry_wait_s: float = 10.0
    max_nonfinite_steps: int = 10  # stop after this many skipped non-finite steps in a row
    loss_spike_factor: float = 0.0  # roll back when the loss exceeds this x its recent mean; 0: off
    loss_spike_window: int = 50  # steps in that recent mean
    sigterm_grace_s: float = 120.0  # on SIGTERM/SIGINT, time allowed for the final save
    # a collective that waits longer for another rank fails the run (a hung rank; 1800 is torch's
    # default); above the longest a rank may legitimately be away: a save, an evaluation, the first
    # step's compile
    collective_timeout_s: float = 1800.0
    # a rank whose own time per step (data wait + forward) is this many times the other ranks'
    # median for straggler_patience logging intervals in a row is named a straggler (console,
    # straggler/* metrics); 0: never named
    straggler_factor: float = 2.0
    straggler_patience: int = 3
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1  # an MoE model's experts split over this many data-parallel ranks
    sequence_parallel: bool = False  # with tensor parallelism: activations between sub-layers split too
    # each sequence split over this many ranks (README: Long context), its attention by all-to-all
    # over heads (ulysses: the heads must divide by the size) or ring attention (ring: any heads)
    context_parallel_size: int = 1
    context_parallel_method: str = "ulysses"
    activation_checkpointing: bool = False
    # each decoder MLP runs over tiles of this many tokens, recomputed one at a time in the backward
    # pass, so its (tokens x intermediate) activations never exist whole (README: Long context); 0: off
    tiled_mlp_tokens: int = 0
    allow_emulated_bf16: bool = False  # bf16 on a CPU without native bf16 (refused otherwise: ~30x slower)
    # torch.compile each decoder block: true, false, or auto (runs of at least
    # llmstack.training.compile.AUTO_MIN_STEPS steps; see that module)
    compile: bool | str = "auto"
    # Which combinations of the above (and of the ds_config's ZeRO stage and precision) run is
    # decided in one place: llmstack.parallel.layout (see run_layout below).


@dataclass
class RunConfig:
    model: dict
    data: DataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: dict = field(default_factory=dict)  # checked by MetricsLogger.from_config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {"data": DataConfig, "train": TrainConfig}
# The encoder-decoder's own architecture keys (train.objective span_corruption).
T5_MODEL_KEYS = [p for p in inspect.signature(LLMStackT5Config.__init__).parameters if p not in ("self", "kwargs")]
MODEL_KEYS = sorted(
    [
        "init_from",
        *(p for p in inspect.signature(LLMStackConfig.__init__).parameters if p not in ("self", "kwargs")),
        *T5_MODEL_KEYS,
    ]
)


def load_run_config(path: str, overrides: Iterable[str] = ()) -> RunConfig:
    if not os.path.isfile(path):
        raise UserError(f"run config {path} not found")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} must be a mapping with sections model, data, train, monitor")
    for item in overrides:
        apply_override(raw, item)
    return parse_run_config(raw, source=path)


def apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    parts = key.split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise UserError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
    section, name = parts
    if not isinstance(raw.setdefault(section, {}), dict):
        raise UserError(f"cannot override {key}: section {section!r} is not a mapping")
    raw[section][name] = yaml.safe_load(value)


def parse_run_config(raw: Mapping[str, Any], source: str = "run config") -> RunConfig:
    unknown = set(raw) - {"model", "monitor", *SECTIONS}
    if unknown:
        raise UserError(_unknown_message(source, sorted(unknown), ["model", "monitor", *SECTIONS]))
    model = {k: _number_or_value(v) for k, v in (raw.get("model") or {}).items()}
    bad = sorted(set(model) - set(MODEL_KEYS))
    if bad:
        raise UserError(_unknown_message(source, [f"model.{k}" for k in bad], MODEL_KEYS))
    if "data" not in raw:
        raise UserError(f"{source} has no data section (data.train or data.sources is required)")
    sections = {name: _build(cls, raw.get(name) or {}, name, source) for name, cls in SECTIONS.items()}
    _check_mixture(sections["data"], source)
    _check_model_source(model, sections["data"].tokenizer, sections["train"].objective, source)
    _check_objective(model, sections["data"], sections["train"], source)
    _check_expert_parallel(model, sections["train"], source)
    _check_context_parallel(model, sections["data"], sections["train"], source)
    if sections["train"].tiled_mlp_tokens < 0:
        raise UserError(f"{source}: train.tiled_mlp_tokens must be 0 (off) or a number of tokens per MLP tile")
    if sections["train"].collective_timeout_s <= 0:
        raise UserError(f"{source}: train.collective_timeout_s must be positive (seconds)")
    if sections["train"].straggler_patience < 1:
        raise UserError(f"{source}: train.straggler_patience must be at least 1 (logging intervals)")
    from .compile import COMPILE_SETTINGS

    if sections["train"].compile not in COMPILE_SETTINGS:
        raise UserError(f"{source}: train.compile must be true, false or auto; got {sections['train'].compile!r}")
    monitor = raw.get("monitor") or {}
    if not isinstance(monitor, dict):
        raise UserError(f"{source}: monitor must be a mapping")
    return RunConfig(model=model, monitor=monitor, **sections)


def _check_mixture(data: DataConfig, source: str) -> None:
    """Mixture sources (data.sources, or data.train given as mappings) are well formed and named
    uniquely, data.weight_by is known and data.schedule schedules those sources: checked here,
    before any start-up."""
    from llmstack.data.mixture import WeightSchedule, check_weight_by, source_names, weights_of
    from llmstack.data.stream import STREAM_SOURCE_KEYS

    check_weight_by(data.weight_by, f"{source}: data.weight_by")
    names = None
    if data.sources:
        names = source_names(data.sources, "paths", STREAM_SOURCE_KEYS, f"{source}: data.sources")
    if any(isinstance(entry, Mapping) for entry in data.train):
        names = source_names(data.train, "prefixes", (), f"{source}: data.train")
    if not data.schedule:
        return
    if names is None:
        raise UserError(
            f"{source}: data.schedule weighs named sources: give data.sources, or data.train as "
            "[{name, prefixes, weight}, ...]"
        )
    if data.sources and data.weight_by == "documents":
        raise UserError(f"{source}: data.schedule schedules a stream's token shares: use data.weight_by: tokens")
    WeightSchedule.from_config(data.schedule, names, weights_of(data.sources or data.train), f"{source}: data.schedule")


def _check_model_source(model: Mapping[str, Any], tokenizer: str | None, objective: str, source: str) -> None:
    """With model.init_from the architecture comes from that directory; without, data.tokenizer is required."""
    from llmstack.models.pretrained import pretrained_config

    from .construct import INIT_FROM_OVERRIDES, check_init_from, with_context_extended

    init_from = model.get("init_from")
    if init_from is None:
        if tokenizer is None:
            raise UserError(f"{source}: data.tokenizer is required (or model.init_from, whose tokenizer is used)")
        return
    architecture = sorted(set(model) - {"init_from", *INIT_FROM_OVERRIDES})
    if architecture:
        raise UserError(
            f"{source}: model.init_from takes the architecture from {init_from}; remove "
            f"{', '.join(f'model.{k}' for k in architecture)} (only {', '.join(INIT_FROM_OVERRIDES)} may be set)"
        )
    check_init_from(str(init_from), tokenizer, objective)
    try:  # RoPE keys extending the context are checked now, not after start-up
        with_context_extended(pretrained_config(str(init_from)), dict(model))
    except ValueError as e:
        raise UserError(f"{source}: model section: {e}") from None


def _check_objective(model: Mapping[str, Any], data: DataConfig, train: TrainConfig, source: str) -> None:
    """The objective exists (causal: a decoder predicting each next token; mlm: a bidirectional
    encoder predicting the tokens llmstack.data.mlm masked); which layouts it runs in is the
    layout table's to say (run_layout)."""
    if train.objective not in OBJECTIVES:
        raise UserError(f"{source}: train.objective must be one of {', '.join(OBJECTIVES)}; got {train.objective!r}")
    if train.objective == "mlm" and not 0.0 < data.mlm_probability < 1.0:
        raise UserError(f"{source}: data.mlm_probability must be between 0 and 1; got {data.mlm_probability}")
    if train.objective == "contrastive":
        _check_contrastive(model, data, train, source)
    if train.objective == "multitask":
        _check_multitask(data, train, source)
    elif train.tasks:
        raise UserError(f"{source}: train.tasks are read with train.objective multitask only")
    if train.objective != "span_corruption" and set(model) & set(T5_MODEL_KEYS):
        keys = ", ".join(f"model.{k}" for k in sorted(set(model) & set(T5_MODEL_KEYS)))
        raise UserError(f"{source}: {keys} configure the encoder-decoder: set train.objective span_corruption")
    if train.objective == "span_corruption":
        _check_span_corruption(model, data, source)


TASK_KEYS = ("name", "kind", "data", "num_labels", "weight")


def _check_multitask(data: DataConfig, train: TrainConfig, source: str) -> None:
    """train.tasks: named tasks of known kinds, each with its data (packed shard prefixes for a
    language model, labelled JSONL, read in full, for a classifier) and a positive weight; one
    trunk (no causal LM beside a masked LM); the weighting known. data.train/sources/valid unused."""
    from llmstack.data.labelled import read_labelled
    from llmstack.models.multitask import CLASSIFICATION_KINDS, TASK_KINDS

    from .multitask import WEIGHTINGS

    where = f"{source}: train.tasks"
    if not train.tasks or not all(isinstance(t, Mapping) for t in train.tasks):
        raise UserError(f"{where} must be a list of {{{', '.join(TASK_KEYS)}}} mappings for train.objective multitask")
    if data.train or data.sources or data.valid:
        raise UserError(
            f"{source}: train.objective multitask reads each task's data from train.tasks; "
            "remove data.train, data.sources and data.valid"
        )
    if train.task_weighting not in WEIGHTINGS:
        raise UserError(
            f"{source}: train.task_weighting must be one of {', '.join(WEIGHTINGS)}; got {train.task_weighting!r}"
        )
    if train.dwa_temperature <= 0:
        raise UserError(f"{source}: train.dwa_temperature must be positive; got {train.dwa_temperature}")
    names = []
    for i, task in enumerate(train.tasks):
        unknown = sorted(set(task) - set(TASK_KEYS))
        if unknown:
            raise UserError(_unknown_message(source, [f"train.tasks[{i}].{k}" for k in unknown], TASK_KEYS))
        name, kind, paths = task.get("name"), task.get("kind"), task.get("data")
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"{where}[{i}].name must be a name of letters, digits and underscores; got {name!r}")
        names.append(name)
        if kind not in TASK_KINDS:
            raise UserError(f"{where}[{i}] ({name}): kind must be one of {', '.join(TASK_KINDS)}; got {kind!r}")
        if isinstance(paths, str):
            task["data"] = paths = [paths]
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise UserError(f"{where}[{i}] ({name}): data must be a path or a list of paths")
        weight = task.setdefault("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise UserError(f"{where}[{i}] ({name}): weight must be a positive number; got {weight!r}")
        if kind in CLASSIFICATION_KINDS:
            labels = task.get("num_labels")
            if isinstance(labels, bool) or not isinstance(labels, int) or labels < 2:
                raise UserError(f"{where}[{i}] ({name}): num_labels must be an integer of at least 2; got {labels!r}")
            read_labelled(paths, kind, labels)
        elif "num_labels" in task:
            raise UserError(f"{where}[{i}] ({name}): a {kind} task has no num_labels (its labels are tokens)")
    if len(set(names)) != len(names):
        raise UserError(f"{where}: task names must be unique; got {names}")
    kinds = {t["kind"] for t in train.tasks}
    if {"causal_lm", "mlm"} <= kinds:
        raise UserError(
            f"{where}: a causal_lm task needs a causal (decoder) trunk and an mlm task a bidirectional "
            "(encoder) one: give tasks of one of the two"
        )
    if "mlm" in kinds and not 0.0 < data.mlm_probability < 1.0:
        raise UserError(f"{source}: data.mlm_probability must be between 0 and 1; got {data.mlm_probability}")


def _check_span_corruption(model: Mapping[str, Any], data: DataConfig, source: str) -> None:
    """The encoder-decoder's architecture (T5 v1.1's options only) and the noise settings."""
    try:
        LLMStackT5Config(**{k: v for k, v in model.items() if k != "init_from"})
    except ValueError as e:
        raise UserError(f"{source}: model section: {e}") from None
    if not 0.0 < data.noise_density < 1.0:
        raise UserError(f"{source}: data.noise_density must be between 0 and 1; got {data.noise_density}")
    if data.mean_noise_span_length < 1:
        raise UserError(f"{source}: data.mean_noise_span_length must be at least 1; got {data.mean_noise_span_length}")


def _check_contrastive(model: Mapping[str, Any], data: DataConfig, train: TrainConfig, source: str) -> None:
    """The contrastive objective's settings, and its JSONL pairs (read in full, every line checked)."""
    from llmstack.data.pairs import read_pairs
    from llmstack.models.embedding import POOLINGS

    if train.pooling not in POOLINGS:
        raise UserError(f"{source}: train.pooling must be one of {', '.join(POOLINGS)}; got {train.pooling!r}")
    if train.temperature <= 0:
        raise UserError(f"{source}: train.temperature must be positive; got {train.temperature}")
    if train.queue_size < 0 or not 0.0 <= train.momentum < 1.0:
        raise UserError(
            f"{source}: train.queue_size must be at least 0 and train.momentum in [0, 1); "
            f"got {train.queue_size} and {train.momentum}"
        )
    if (
        not data.train
        or data.sources
        or any(not isinstance(p, str) or not p.endswith(".jsonl") for p in [*data.train, *data.valid])
    ):
        raise UserError(
            f"{source}: train.objective contrastive reads data.train (and data.valid) as JSONL files "
            "(*.jsonl) of {query, positive} or {text} records; data.sources are not read"
        )
    unsupervised = read_pairs(data.train)[1]
    if data.valid:
        read_pairs(data.valid)
    if unsupervised and not (model.get("hidden_dropout") or model.get("attention_dropout")):
        raise UserError(
            f"{source}: data.train holds single texts (SimCSE: each text twice, the copies differing by "
            "dropout), but the model has no dropout: set model.hidden_dropout (e.g. 0.1)"
        )


def run_layout(run: RunConfig, ds_config: Mapping[str, Any], variable_length: bool = False) -> Layout:
    """The run's layout, from the run config and its ds_config, before anything starts.
    `variable_length`: the run trains padded batches of varying shape (fine-tuning data)."""
    from .compile import compile_wanted
    from .ds_config import gradient_compression, zero_stage

    train, model = run.train, run.model
    if "init_from" in model:
        from llmstack.models.pretrained import pretrained_config

        model = pretrained_config(str(model["init_from"])).to_dict()
    kind = "moe" if model.get("num_local_experts") else "dense"
    if model.get("attention_pattern") == "bigbird":
        kind = "bigbird"
    precision = next((p for p in ("bf16", "fp16") if (ds_config.get(p) or {}).get("enabled")), "fp32")
    stays_eager = (
        train.context_parallel_size > 1
        or train.tiled_mlp_tokens > 0
        or train.objective in ("multitask", "span_corruption")
    )
    optimizer = str((ds_config.get("optimizer") or {}).get("type", "")).lower()
    return Layout(
        tensor=train.tensor_parallel_size,
        pipeline=train.pipeline_parallel_size,
        expert=train.expert_parallel_size,
        context=train.context_parallel_size,
        context_method=train.context_parallel_method,
        zero_stage=zero_stage(ds_config),
        sequence_parallel=train.sequence_parallel,
        precision=precision,
        # auto leaves context-parallel, tiled-MLP, multi-task and encoder-decoder runs eager (compiling
        # them is refused: see the layout table)
        compile=compile_wanted(train.compile, train.max_steps) and not (train.compile == "auto" and stays_eager),
        activation_checkpointing=train.activation_checkpointing,
        tiled_mlp_tokens=train.tiled_mlp_tokens,
        objective=train.objective,
        momentum_queue=train.objective == "contrastive" and train.queue_size > 0,
        model=kind,
        streamed=bool(run.data.sources),
        weighted_shards=any(isinstance(entry, Mapping) for entry in run.data.train),
        init_from="init_from" in run.model,
        variable_length=variable_length,
        document_masking=run.data.document_masking,
        onebit_adam=optimizer == "onebitadam",
        grad_clip=train.grad_clip > 0,
        gradient_compression=(gradient_compression(ds_config, train) or {}).get("method", "none"),
        overlap_comm=bool((ds_config.get("zero_optimization") or {}).get("overlap_comm", False)),
    )


def _check_context_parallel(model: Mapping[str, Any], data: DataConfig, train: TrainConfig, source: str) -> None:
    """Each sequence cuts into 2 x train.context_parallel_size equal chunks (a head and a tail per
    rank), and Ulysses gives each rank whole heads; the heads of a model from init_from are
    checked once the model exists (context_parallelize)."""
    size = train.context_parallel_size
    if size > 1 and data.seq_len % (2 * size):
        raise UserError(
            f"{source}: data.seq_len ({data.seq_len}) must be a multiple of 2 x train.context_parallel_size "
            f"(= {2 * size}): each rank holds two equal chunks of every sequence"
        )
    if size > 1 and "init_from" not in model:
        heads = int(model.get("num_attention_heads") or LLMStackConfig().num_attention_heads)
        check_context_heads(heads, size, train.context_parallel_method, train.tensor_parallel_size)


def _check_expert_parallel(model: Mapping[str, Any], train: TrainConfig, source: str) -> None:
    """Expert parallelism splits the experts of an MoE decoder trained with data parallelism alone;
    a model from init_from is checked once its config is read (Trainer.moe_window), and the
    data-parallel size once the ranks are known (Topology)."""
    size = train.expert_parallel_size
    if size < 1:
        raise UserError(f"{source}: train.expert_parallel_size must be at least 1; got {size}")
    if size == 1 or "init_from" in model:
        return
    experts = int(model.get("num_local_experts") or 0)
    if not experts or experts % size:
        raise UserError(
            f"{source}: train.expert_parallel_size {size} must divide model.num_local_experts ({experts}): "
            "expert parallelism splits the experts of a mixture-of-experts model"
        )


def _number_or_value(value: object) -> object:
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _build(cls: type[Any], values: Mapping[str, Any], section: str, source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(_unknown_message(source, [f"{section}.{k}" for k in unknown], sorted(fields)))
    missing = [
        n
        for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UserError(f"{source}: missing required key(s) {', '.join(f'{section}.{m}' for m in missing)}")
    values = {name: _coerce(f"{section}.{name}", value, fields[name].type, source) for name, value in values.items()}
    return cls(**values)


def _coerce(key: str, value: object, expected: object, source: str) -> object:
    """Check a value against its field's type. Numbers written as YAML strings (YAML 1.1 reads
    `3e-4` as a string) become numbers, and a single path becomes a one-item list."""
    if value is None and "None" in str(expected):
        return None
    if expected == bool | str:  # a switch with a named third setting, e.g. train.compile: auto
        if not isinstance(value, (bool, str)):
            raise UserError(f"{source}: {key} must be true, false or a setting's name; got {value!r}")
        return value
    base = next((t for t in (bool, int, float, list, dict, str) if t is expected or t.__name__ in str(expected)), None)
    try:
        if base is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, (int, str)) and not isinstance(value, bool):
            return int(value)
        if base is list and isinstance(value, str):
            return [value]
    except ValueError:
        pass
    if base is not None and not isinstance(value, base):
        raise UserError(f"{source}: {key} must be a {base.__name__}; got {value!r}")
    return value


def _unknown_message(source: str, keys: Iterable[str], valid: Iterable[str]) -> str:
    return f"{source}: unknown key(s) {', '.join(keys)}; valid keys are: {', '.join(valid)}"
