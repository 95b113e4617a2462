"""Turn a training checkpoint or a saved model into a Hugging Face model directory.

A checkpoint's full fp32 weights come from, by its layout:
- tensor/pipeline-split shards: llmstack.parallel merges them by the rule that split them;
- ZeRO shards: DeepSpeed's zero_to_fp32 reassembles every parameter from the fp32 master
  partitions of any stage and data-parallel size, frozen parameters included;
- neither (ZeRO stage 0): the model-states file holds the whole model;
- expert files (expert parallelism, .checkpoint.experts): the model-states file holds the rest of
  the model and the files every expert, as the model computed with them (zero_to_fp32 cannot
  reassemble experts partitioned per expert group).
The checkpoint is verified against its manifest first, and read without unpickling code.
"""

import json
import os
import tempfile
from typing import cast

import torch
from transformers import AutoConfig, PreTrainedModel

from llmstack.errors import UserError
from llmstack.models import (
    FAMILIES,
    LLMStackConfig,
    LLMStackEmbeddingConfig,
    LLMStackEncoderConfig,
    LLMStackForCausalLM,
    LLMStackForEmbedding,
    LLMStackForMaskedLM,
    LLMStackForMultitask,
    LLMStackForSpanCorruption,
    LLMStackMultitaskConfig,
    LLMStackT5Config,
    model_for,
    to_hf,
)
from llmstack.models.classification_interop import to_sequence_classification
from llmstack.models.encoder_interop import ENCODER_FAMILIES, to_eurobert
from llmstack.models.hf_interop import copy_weights, to_hf_config
from llmstack.models.t5_interop import T5_FAMILIES, to_t5
from llmstack.safe_load import load_tensors, safe_loading

from .checkpoint.experts import merged_experts
from .checkpoint.files import LATEST_FILE, NO_MANIFEST, CorruptManifest, file_problems, read_latest, read_manifest

SENTENCE_TRANSFORMERS = "sentence-transformers"  # an embedding model's stock format
FORMATS = ("llmstack", *FAMILIES, *ENCODER_FAMILIES, *T5_FAMILIES, SENTENCE_TRANSFORMERS)
# Masked LMs `llmstack eval` scores on masked tokens: llmstack's encoder and its stock export.
MASKED_LM_MODEL_TYPES = (LLMStackEncoderConfig.model_type, *ENCODER_FAMILIES)
# Encoder-decoders (span corruption): llmstack's and its stock T5 export.
SEQ2SEQ_MODEL_TYPES = (LLMStackT5Config.model_type, *T5_FAMILIES)


def is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path)
    )


def model_type(directory: str) -> str | None:
    """The model_type in `directory`'s config.json."""
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f).get("model_type")


TrainedModel = (
    LLMStackForCausalLM | LLMStackForMaskedLM | LLMStackForEmbedding | LLMStackForMultitask | LLMStackForSpanCorruption
)


def llmstack_class(directory: str) -> type[TrainedModel]:
    """The llmstack model class of the config in `directory`: the encoder's, the embedding model's,
    the multi-task model's, the encoder-decoder's or the decoder's."""
    kind = model_type(directory)
    if kind == LLMStackEmbeddingConfig.model_type:
        return LLMStackForEmbedding
    if kind == LLMStackMultitaskConfig.model_type:
        return LLMStackForMultitask
    if kind == LLMStackT5Config.model_type:
        return LLMStackForSpanCorruption
    return LLMStackForMaskedLM if kind == LLMStackEncoderConfig.model_type else LLMStackForCausalLM


def checkpoint_root_and_tag(path: str) -> tuple[str, str | None]:
    """(directory holding config.json and `latest`, tag or None) for a checkpoint root or one tag in it."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, LATEST_FILE)):
        return path, None
    parent = os.path.dirname(path)
    if os.path.isfile(os.path.join(parent, "config.json")) and os.path.isdir(path):
        return parent, os.path.basename(path)
    raise UserError(
        f"{path} is neither a model directory (config.json + *.safetensors) nor a training checkpoint "
        "(OUT_DIR/checkpoints or OUT_DIR/checkpoints/global_stepN)"
    )


def check_checkpoint(tag_dir: str, trust: bool = False) -> None:
    """Refuse a checkpoint whose files contradict its manifest or whose manifest is unreadable, or
    that has none unless `trust`."""
    try:
        files = read_manifest(tag_dir)
    except CorruptManifest as e:
        raise UserError(f"checkpoint {tag_dir} is damaged: {e}") from None
    if files is None:
        if not trust:
            raise UserError(f"checkpoint {tag_dir} has {NO_MANIFEST}; pass --trust-checkpoint to load it anyway")
        return
    problems = file_problems(tag_dir, files)
    if problems:
        raise UserError(f"checkpoint {tag_dir} is damaged: {'; '.join(problems)}")


def consolidated_state_dict(root: str, tag: str | None = None, trust: bool = False) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor} of checkpoint `root/tag` (`latest` when tag is None)."""
    from llmstack.compat.deepspeed import checkpoint_files, zero3_replicated_state_dict, zero_to_fp32_state_dict
    from llmstack.parallel import is_model_parallel_checkpoint, load_full_state_dict

    tag = tag or read_latest(root)
    if tag is None:
        raise UserError(f"{root} has no {LATEST_FILE} checkpoint: name one, e.g. {root}/global_stepN")
    tag_dir = os.path.join(root, tag)
    if not os.path.isdir(tag_dir):
        raise UserError(f"checkpoint {tag_dir} not found")
    check_checkpoint(tag_dir, trust)
    experts = merged_experts(tag_dir)  # the model states hold one expert-parallel rank's
    if is_model_parallel_checkpoint(tag_dir):
        with safe_loading():
            merged = {**load_full_state_dict(tag_dir, LLMStackConfig.from_pretrained(root)), **experts}
        return {k: v.float() for k, v in merged.items()}
    files = checkpoint_files(tag_dir)
    if experts and files.partitioned_model_states:  # ZeRO-3: the rest from the shards
        with safe_loading():
            shards = [load_tensors(files.zero_shards[key]) for key in sorted(files.zero_shards)]
            dense = zero3_replicated_state_dict(load_tensors(files.partitioned_model_states[0, 0]), shards)
        return {k: v.float() for k, v in {**dense, **experts}.items()}
    if experts or not files.zero_shards:
        states = {**load_tensors(files.model_states[0])["module"], **experts}
        return {k: v.float() for k, v in states.items()}
    with safe_loading():
        return zero_to_fp32_state_dict(root, tag)


def load_trained_model(path: str, trust: bool = False) -> TrainedModel:
    """An LLMStackForCausalLM, or LLMStackForMaskedLM for an encoder, LLMStackForEmbedding for an
    embedding model, LLMStackForMultitask for a multi-task one, LLMStackForSpanCorruption for an
    encoder-decoder (fp32, eval mode), from a model directory or a training checkpoint."""
    if not os.path.exists(path):
        raise UserError(f"{path} not found")
    if is_model_dir(path):
        return llmstack_class(path).from_pretrained(path).eval()
    root, tag = checkpoint_root_and_tag(path)
    config = AutoConfig.from_pretrained(root)
    if not isinstance(config, LLMStackConfig):
        raise UserError(f"{root}/config.json is not an llmstack model's (model_type {config.model_type!r})")
    model = model_for(config)
    missing, unexpected = model.load_state_dict(consolidated_state_dict(root, tag, trust), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise UserError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def export_hf(path: str, out_dir: str, fmt: str = "llmstack", trust: bool = False, task: str | None = None) -> str:
    """Write a Hugging Face directory (safetensors): llmstack format (needs `import llmstack`), a
    Llama, Mistral or Qwen2 one for a decoder, a EuroBERT one for an encoder, a T5 one for an
    encoder-decoder (these load in stock transformers); of a multi-task model, `task`'s sequence
    classifier in the stock format of its trunk. The tokenizer is copied when the source has one."""
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}")
    model = load_trained_model(path, trust)
    tokenizer_dir = path if is_model_dir(path) else checkpoint_root_and_tag(path)[0]
    if isinstance(model, LLMStackForMultitask) and fmt != "llmstack":
        return export_sequence_classifier(model, task, fmt, tokenizer_dir, out_dir)
    if task is not None:
        raise UserError("--task names a multi-task model's classification task; this model has no tasks")
    if isinstance(model, LLMStackForSpanCorruption) != (fmt in T5_FAMILIES) and fmt != "llmstack":
        if isinstance(model, LLMStackForSpanCorruption):
            raise UserError(f"{path} is an encoder-decoder; export it with --format t5 or llmstack")
        raise UserError(f"{path} is not an encoder-decoder; --format t5 exports span-corruption encoder-decoders")
    if isinstance(model, LLMStackForSpanCorruption) and fmt in T5_FAMILIES:
        return save_with_tokenizer(to_t5(model), tokenizer_dir, out_dir)
    if isinstance(model, LLMStackForEmbedding) != (fmt == SENTENCE_TRANSFORMERS) and fmt != "llmstack":
        if isinstance(model, LLMStackForEmbedding):
            raise UserError(
                f"{path} is an embedding model; export it with --format {SENTENCE_TRANSFORMERS} or llmstack"
            )
        raise UserError(f"{path} is not an embedding model; --format {SENTENCE_TRANSFORMERS} exports embedding models")
    if isinstance(model, LLMStackForEmbedding) and fmt == SENTENCE_TRANSFORMERS:
        return export_sentence_transformers(model, tokenizer_dir, out_dir)
    encoder = isinstance(model, LLMStackForMaskedLM)
    if fmt != "llmstack" and encoder != (fmt in ENCODER_FAMILIES):
        formats = ENCODER_FAMILIES if encoder else tuple(FAMILIES)
        kind = "an encoder (masked LM)" if encoder else "a decoder (causal LM)"
        raise UserError(f"{path} is {kind}; export it with --format {' or '.join(('llmstack', *formats))}")
    out_model: PreTrainedModel
    try:
        if fmt == "llmstack":
            out_model = model
        elif isinstance(model, LLMStackForMaskedLM):
            out_model = to_eurobert(model)
        else:
            out_model = to_hf(cast(LLMStackForCausalLM, model), fmt)  # embedding models left above
    except ValueError as e:
        raise UserError(str(e)) from None
    return save_with_tokenizer(out_model, tokenizer_dir, out_dir)


def save_with_tokenizer(model: PreTrainedModel, tokenizer_dir: str, out_dir: str) -> str:
    """Save `model` to `out_dir`, with the tokenizer of `tokenizer_dir` when it has one."""
    model.save_pretrained(out_dir)
    if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def export_sequence_classifier(
    model: LLMStackForMultitask, task: str | None, fmt: str, tokenizer_dir: str, out_dir: str
) -> str:
    """`task`'s head with the trunk as the stock sequence classifier of format `fmt`
    (llmstack.models.classification_interop), with the tokenizer when there is one."""
    names = [t["name"] for t in model.config.tasks if t["kind"] == "sequence_classification"]
    if task is None:
        raise UserError(f"a multi-task model exports one sequence classification task: give --task (one of {names})")
    if fmt not in (*FAMILIES, *ENCODER_FAMILIES):
        raise UserError(
            f"a multi-task model's classifier exports with --format {', '.join((*FAMILIES, *ENCODER_FAMILIES))}"
        )
    try:
        classifier = to_sequence_classification(model, task, fmt)
    except ValueError as e:
        raise UserError(str(e)) from None
    classifier.save_pretrained(out_dir)
    if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def export_sentence_transformers(model: LLMStackForEmbedding, tokenizer_dir: str, out_dir: str) -> str:
    """A directory `sentence_transformers.SentenceTransformer(out_dir)` loads without llmstack: the
    trunk as a stock LlamaModel with the tokenizer, the model's pooling ("lasttoken" for last)
    and unit-length normalisation, so its embeddings are `LLMStackForEmbedding.embed`'s."""
    try:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        raise UserError('--format sentence-transformers needs: pip install "llmstack[embeddings]"') from None
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise UserError(f"{tokenizer_dir} has no tokenizer, which sentence-transformers needs")
    try:
        trunk = copy_weights(model.model, LlamaModel(cast(LlamaConfig, to_hf_config(model.config, "llama"))), "llama")
    except ValueError as e:
        raise UserError(str(e)) from None
    with tempfile.TemporaryDirectory() as staging:
        trunk.save_pretrained(staging)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.padding_side = "right"  # as llmstack.data.pairs pads
        tokenizer.save_pretrained(staging)
        transformer = Transformer(staging, max_seq_length=model.config.max_position_embeddings)
        pooling = Pooling(model.config.hidden_size, "lasttoken" if model.config.pooling == "last" else "mean")
        SentenceTransformer(modules=[transformer, pooling, Normalize()]).save(out_dir)
    return out_dir
