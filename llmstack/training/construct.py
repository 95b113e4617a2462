"""The model a run trains: freshly initialised, or loaded from `model.init_from`, built as its
layout needs.

- Whole (ZeRO 0-2, tensor, pipeline or expert parallel): every rank builds the whole model from the
  same seed, so the replicas are equal, and copies `init_from` into it; tensor/pipeline/expert
  parallelism then keeps each rank's part. The layouts need the whole model on every rank at some point anyway.
- ZeRO-3 alone: the model is built under `deepspeed.zero.Init`, which partitions each module's
  parameters as soon as that module is constructed, so a rank holds its 1/N of the model plus
  about one module at a time (bench/bench_construct.py). The random initialisation runs module by
  module on whole parameters that each rank computes alike and keeps its partition of, in the
  order and with the random stream of whole construction (same seed, same weights: checked in
  fp32; under bf16/fp16 DeepSpeed creates the parameters in that dtype), and `init_from` is read
  one parameter at a time. Nothing is gathered: on gloo an all-gather holds a parameter twice.
"""

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from llmstack.compat.deepspeed import whole_on_this_rank, write_zero3_partition
from llmstack.errors import UserError
from llmstack.models import (
    LLMStackConfig,
    LLMStackEmbeddingConfig,
    LLMStackEncoderConfig,
    LLMStackMultitaskConfig,
    LLMStackT5Config,
    model_for,
)
from llmstack.models.modeling_llmstack import LLMStackPreTrainedModel
from llmstack.models.pretrained import PretrainedWeights, load_pretrained_weights, pretrained_config
from llmstack.parallel import Topology

from .ds_config import zero_stage

# Model fields a run may change on top of a pretrained config: training behaviour, not architecture.
# What a run may set beside model.init_from: regularisation, and the RoPE keys that extend the context.
INIT_FROM_OVERRIDES = (
    "hidden_dropout",
    "attention_dropout",
    "label_smoothing",
    "z_loss",
    "max_position_embeddings",
    "rope_parameters",
)
# RoPE types whose frequencies depend on the context the model was trained at.
ROPE_TYPES_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn")


def build_model_config(
    model_fields: dict,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    encoder: bool = False,
    pooling: str | None = None,
    multitask: dict[str, Any] | None = None,
    encoder_decoder: bool = False,
) -> LLMStackConfig:
    """The run's model config: `model_fields` on top of the tokenizer's sizes, or the config of
    `model_fields["init_from"]` with the overrides INIT_FROM_OVERRIDES allows. `encoder`: a
    masked-LM encoder's config, whose mask token is the tokenizer's (an init_from encoder's must be);
    `pooling`: an embedding model's config, pooling so (llmstack.models.embedding); `multitask`:
    a multi-task model's config fields (tasks, learn_task_variance; llmstack.models.multitask);
    `encoder_decoder`: a span-corruption encoder-decoder's (llmstack.models.modeling_t5)."""
    fields = dict(model_fields)
    init_from = fields.pop("init_from", None)
    config_class: type[LLMStackConfig] = LLMStackConfig
    encoder_fields: dict[str, Any] = {}
    if encoder:
        config_class, encoder_fields = LLMStackEncoderConfig, {"mask_token_id": mask_token_id(tokenizer)}
    if pooling is not None:
        config_class, encoder_fields = LLMStackEmbeddingConfig, {"pooling": pooling}
    if multitask is not None:
        masks = any(task["kind"] == "mlm" for task in multitask["tasks"])
        config_class = LLMStackMultitaskConfig
        encoder_fields = {**multitask, **({"mask_token_id": mask_token_id(tokenizer)} if masks else {})}
    elif encoder_decoder:
        config_class = LLMStackT5Config
    try:
        if init_from is not None:
            config = with_context_extended(pretrained_config(init_from), fields)
            config.update(fields)
            if encoder and config.mask_token_id != encoder_fields["mask_token_id"]:
                raise ValueError(
                    f"init_from {init_from} masks with token {config.mask_token_id}, the tokenizer with "
                    f"{encoder_fields['mask_token_id']}: train with the tokenizer saved beside the encoder"
                )
        else:
            config = config_class(
                **{
                    "vocab_size": len(tokenizer),
                    "eos_token_id": tokenizer.eos_token_id,
                    "pad_token_id": tokenizer.pad_token_id,
                    "max_position_embeddings": max(seq_len, 1024),
                    **encoder_fields,
                    **fields,
                }
            )
    except ValueError as e:
        raise UserError(f"model section: {e}") from None
    if config.vocab_size < len(tokenizer):
        raise UserError(f"model.vocab_size {config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    return config


def with_context_extended(config: LLMStackConfig, fields: dict) -> LLMStackConfig:
    """`config` with the RoPE keys of `fields` (popped from it) applied: continued pretraining at a
    longer context than the model's. `rope_parameters` replaces the model's RoPE variant; its
    rope_theta defaults to the model's, and a llama3 or yarn variant's
    original_max_position_embeddings to the model's max_position_embeddings (the context it was
    trained at), not the new one. The config is rebuilt so that transformers standardizes and checks
    the new parameters as it does on loading."""
    rope = fields.pop("rope_parameters", None)
    max_positions = fields.pop("max_position_embeddings", None)
    if rope is None and max_positions is None:
        return config
    params = dict(config.rope_parameters if rope is None else rope)
    params.setdefault("rope_theta", config.rope_parameters["rope_theta"])
    if params.get("rope_type") in ROPE_TYPES_WITH_ORIGINAL_CONTEXT:
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    try:
        return type(config)(
            **{
                **config.to_dict(),
                "max_position_embeddings": max_positions or config.max_position_embeddings,
                "rope_parameters": params,
            }
        )
    except KeyError as e:  # transformers' check of the type's required keys
        raise ValueError(f"rope_parameters: {e.args[0]}") from None


def mask_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's mask token, which a masked-LM run needs."""
    if tokenizer.mask_token_id is None:
        raise UserError(
            "the tokenizer has no mask token for train.objective mlm; train one with "
            "`llmstack data train-tokenizer --encoder-tokens`"
        )
    return int(tokenizer.mask_token_id)


def uses_partitioned_construction(ds_config: dict, topology: Topology) -> bool:
    """ZeRO-3 over more than one replica (data x context ranks), without tensor/pipeline/expert
    parallelism (which split a whole model; ZeRO-3 then partitions experts over their own group,
    not the data-parallel one)."""
    split = topology.tensor_parallel_size * topology.pipeline_parallel_size * topology.expert_parallel_size > 1
    return zero_stage(ds_config) == 3 and topology.get_data_parallel_world_size() > 1 and not split


def build_model(
    model_fields: dict,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    ds_config: dict,
    topology: Topology,
    encoder: bool = False,
    pooling: str | None = None,
    multitask: dict[str, Any] | None = None,
    encoder_decoder: bool = False,
) -> LLMStackPreTrainedModel:
    """The model, initialised from the current random state or loaded from model.init_from;
    `encoder`: a fresh masked-LM encoder; `pooling`: a fresh embedding model pooling so;
    `multitask`: a fresh multi-task model of these config fields; `encoder_decoder`: a fresh
    span-corruption encoder-decoder."""
    config = build_model_config(model_fields, tokenizer, seq_len, encoder, pooling, multitask, encoder_decoder)
    init_from = model_fields.get("init_from")
    if not uses_partitioned_construction(ds_config, topology):
        model = model_for(config)
        if init_from is not None:
            _load(load_pretrained_weights, model, init_from)
        return model
    import deepspeed

    map_large_allocations()
    with deepspeed.zero.Init(data_parallel_group=topology.replica_group, config_dict_or_path=ds_config):
        with init_on_whole_parameters():
            model = model_for(config)
    if init_from is not None:
        _load(load_partitioned_weights, model, init_from)
    return model


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Have glibc serve allocations of `threshold` bytes or more with mmap, so that the whole
    module tensors freed right after partitioning go back to the operating system. Otherwise
    glibc's adaptive threshold rises to 32 MiB and freed tensors stay in its heap: measured with
    bench/bench_construct.py (1.16 GB model, 2 ranks), a rank's peak was 0.78-0.93 of the model
    without this and 0.62 with it.
    No-op where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (malloc.h); also turns the adaptive threshold off
    except (OSError, AttributeError, TypeError):
        pass


def _load(load: Callable[[LLMStackPreTrainedModel, str], None], model: LLMStackPreTrainedModel, path: str) -> None:
    try:
        load(model, path)
    except ValueError as e:
        raise UserError(f"model.init_from {path}: {e}") from None


@contextmanager
def init_on_whole_parameters() -> Iterator[None]:
    """Make the model's weight initialisation, which transformers runs module by module at the end
    of construction, give each module's ZeRO-3-partitioned parameters their whole shape on every
    rank, initialise them there (all ranks draw the same random numbers) and keep each rank's
    partition; no communication, one module's parameters whole at a time."""
    original = LLMStackPreTrainedModel._init_weights

    def init_whole(self: LLMStackPreTrainedModel, module: nn.Module) -> None:
        with whole_on_this_rank(list(module.parameters(recurse=False))):
            original(self, module)

    LLMStackPreTrainedModel._init_weights = init_whole  # type: ignore[method-assign]  # patched for construction
    try:
        yield
    finally:
        LLMStackPreTrainedModel._init_weights = original  # type: ignore[method-assign]


@torch.no_grad()
def load_partitioned_weights(model: LLMStackPreTrainedModel, path: str) -> None:
    """Copy `path`'s weights into a ZeRO-3-partitioned model one parameter at a time: every rank
    reads the tensor and keeps its partition of it (no communication)."""
    weights = PretrainedWeights(path)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    weights.check_names(model.config, names)
    for name, param in model.named_parameters():
        write_zero3_partition(param, weights.tensor_for(name, model.config))


def check_init_from(path: str, tokenizer: str | None, objective: str = "causal") -> None:
    """Refuse before start-up an init_from that is not a model directory, that brings no
    tokenizer when data.tokenizer is not given, or whose kind (decoder, encoder) is not the one
    the objective trains."""
    from llmstack.models.pretrained import is_pretrained_dir

    if not is_pretrained_dir(path):
        raise UserError(f"model.init_from {path} is not a model directory (config.json and *.safetensors)")
    with open(os.path.join(path, "config.json")) as f:
        is_encoder = json.load(f).get("model_type") == LLMStackEncoderConfig.model_type
    if is_encoder != (objective == "mlm"):
        kind, needs = ("an encoder", "a decoder") if is_encoder else ("a decoder", "an encoder")
        raise UserError(
            f"model.init_from {path} is {kind}, and train.objective {objective} trains {needs}: "
            f"set train.objective {'mlm' if is_encoder else 'causal'} or start from {needs}"
        )
    has_tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    if tokenizer is None and not has_tokenizer:
        raise UserError(f"model.init_from {path} has no tokenizer; give data.tokenizer")
