"""Conversion between llmstack models and the stock transformers Llama, Mistral, Qwen2 and Mixtral classes.

llmstack's parameter names are those of all three families, so the state dict passes through
unchanged; only the config is translated, one table entry per family:

    llama     GQA, tied or untied head, RoPE default / linear / dynamic / llama3 / yarn
    mistral   + sliding-window attention on every layer, head_dim of its own
    qwen2     + biases on q/k/v, sliding window on the layers `layer_types` names
    mixtral   mistral with a top-k mixture-of-experts MLP in every layer (llmstack.models.moe
              stores its experts under Mixtral's names: mlp.gate, mlp.experts.gate_up_proj/down_proj)

A stock config is imported only if nothing in it is lost: the imported config is translated back
and every architectural field must come back equal, so a feature llmstack does not implement
(Llama's attention_bias or mlp_bias, longrope, partial rotary, ...) is refused by name.
"""

import re
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from .configuration_llmstack import LLMStackConfig
from .modeling_llmstack import LLMStackForCausalLM
from .mup import width_multiplier

# Fields with the same name and meaning in llmstack's and every family's config.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

# Stock config fields that do not change what the model computes.
NON_ARCHITECTURAL = {
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "dtype",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "use_cache",
    "_name_or_path",
    "model_type",
    "pretraining_tp",
    "max_window_layers",  # Qwen2: superseded by layer_types
    "output_router_logits",
}


@dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    model_class: type
    fixed: dict = field(default_factory=dict)  # stock fields llmstack's architecture implies


FAMILIES = {
    "llama": Family("llama", LlamaConfig, LlamaForCausalLM, {"attention_bias": False, "mlp_bias": False}),
    "mistral": Family("mistral", MistralConfig, MistralForCausalLM),
    "qwen2": Family("qwen2", Qwen2Config, Qwen2ForCausalLM),
    "mixtral": Family("mixtral", MixtralConfig, MixtralForCausalLM, {"router_jitter_noise": 0.0}),
}
QKV_BIAS_FAMILIES = ("qwen2",)
MOE_FAMILIES = ("mixtral",)
SLIDING_EVERY_LAYER_FAMILIES = ("mistral", "mixtral")


def _moe_fields(config: LLMStackConfig, family: str) -> dict[str, Any]:
    """The family's mixture-of-experts fields for `config`; ValueError if the family cannot express them."""
    if family not in MOE_FAMILIES:
        if config.num_local_experts:
            raise ValueError(
                f"{family} has no mixture-of-experts layers (num_local_experts); export with --format mixtral"
            )
        return {}
    if not config.num_local_experts:
        raise ValueError(
            "mixtral needs mixture-of-experts layers (num_local_experts > 0); export with --format mistral"
        )
    lacks = {
        "moe_layers (MoE on some layers only)": config.moe_layers not in (None, list(range(config.num_hidden_layers))),
        "moe_shared_intermediate_size (shared experts)": bool(config.moe_shared_intermediate_size),
        "moe_norm_topk_prob=False": not config.moe_norm_topk_prob,
    }
    lacking = [name for name, lacked in lacks.items() if lacked]
    if lacking:
        raise ValueError(f"mixtral has no {', '.join(lacking)}; export with --format llmstack")
    return {
        "intermediate_size": config.moe_intermediate_size,
        "num_local_experts": config.num_local_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "router_aux_loss_coef": config.router_aux_loss_coef,
    }


def _sliding_window_fields(config: LLMStackConfig, family: str) -> dict[str, Any]:
    """The family's sliding-window fields for `config`; ValueError if the family cannot express them."""
    layer_types = _layer_types(config)
    if family == "qwen2":
        return {
            "use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window,
            "layer_types": layer_types,
        }
    every_layer = family in SLIDING_EVERY_LAYER_FAMILIES
    if config.sliding_window is None:
        return {"sliding_window": None} if every_layer else {}
    if every_layer and "full_attention" not in layer_types:
        return {"sliding_window": config.sliding_window}
    which = "on some layers only" if every_layer else "at all"
    raise ValueError(f"{family} has no sliding-window attention {which} (sliding_window); export with --format qwen2")


def _layer_types(config: LLMStackConfig) -> list[str]:
    kind = "sliding_attention" if config.sliding_window is not None else "full_attention"
    return list(config.layer_types or [kind] * config.num_hidden_layers)


def check_standard_parametrisation(config: LLMStackConfig, family: str) -> None:
    """ValueError for a µP model (width multiplier != 1): stock configs have no output multiplier
    nor attention-scale field, so the family's model would compute other logits."""
    m = width_multiplier(config)
    if m != 1.0:
        raise ValueError(
            f"{family} has no µP output and attention multipliers (mup_base_width {config.mup_base_width}, "
            f"hidden_size {config.hidden_size}: width multiplier {m:g}); export with --format llmstack"
        )


def to_hf_config(config: LLMStackConfig, family: str) -> PretrainedConfig:
    """The stock `family` config of an llmstack config; ValueError naming what the family lacks."""
    fam = FAMILIES[family]
    if config.norm_position != "pre" or config.activation != "swiglu":
        raise ValueError(
            f"only pre-LN SwiGLU models have a {family} equivalent; this model has "
            f"norm_position={config.norm_position!r}, activation={config.activation!r}. "
            "Export it with --format llmstack instead."
        )
    if config.attention_pattern != "dense":
        raise ValueError(f"{family} has no sparse attention (attention_pattern bigbird); export with --format llmstack")
    check_standard_parametrisation(config, family)
    if config.qkv_bias and family not in QKV_BIAS_FAMILIES:
        raise ValueError(f"{family} has no q/k/v biases (qkv_bias); export with --format qwen2")
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    fields.update(_moe_fields(config, family))
    return fam.config_class(
        **fields,
        rope_parameters=dict(config.rope_parameters),
        hidden_act="silu",
        **fam.fixed,
        **_sliding_window_fields(config, family),
    )


def from_hf_config(hf_config: PretrainedConfig) -> LLMStackConfig:
    """The llmstack config of a stock Llama, Mistral, Qwen2 or Mixtral config; ValueError naming any field
    whose value llmstack cannot reproduce."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported (only SiLU-gated MLPs)")
    sliding_window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None) if sliding_window is not None else None
    try:
        config = LLMStackConfig(
            **{name: getattr(hf_config, name) for name in SHARED_FIELDS if hasattr(hf_config, name)},
            rope_parameters=dict(hf_config.rope_parameters),
            sliding_window=sliding_window,
            layer_types=layer_types,
            qkv_bias=family in QKV_BIAS_FAMILIES,
            **_llmstack_moe_fields(hf_config),
        )
    except ValueError as e:
        raise ValueError(f"{family} config: {e}") from None
    lost = _lost_fields(hf_config, to_hf_config(config, family))
    if lost:
        raise ValueError(f"{family} config features llmstack does not implement: {', '.join(lost)}")
    return config


def _llmstack_moe_fields(hf_config: PretrainedConfig) -> dict[str, Any]:
    if hf_config.model_type not in MOE_FAMILIES:
        return {}
    return {
        "num_local_experts": hf_config.num_local_experts,
        "num_experts_per_tok": hf_config.num_experts_per_tok,
        "router_aux_loss_coef": hf_config.router_aux_loss_coef,
    }


def _lost_fields(source: PretrainedConfig, rebuilt: PretrainedConfig) -> list[str]:
    """`key=value` of each architectural field of `source` that `rebuilt` does not reproduce (a
    field `rebuilt` lacks is harmless only when unset or False in `source`)."""
    source_fields, rebuilt_fields = _with_head_dim(source.to_dict()), _with_head_dim(rebuilt.to_dict())
    lost = []
    for key, value in sorted(source_fields.items()):
        if key in NON_ARCHITECTURAL or (key not in rebuilt_fields and value in (None, False)):
            continue
        if key not in rebuilt_fields or rebuilt_fields[key] != value:
            lost.append(f"{key}={value!r}")
    return lost


def _with_head_dim(fields: dict[str, Any]) -> dict[str, Any]:
    """Config fields with an unset head_dim (Mixtral's default) given its implied value."""
    if fields.get("head_dim") is None and "num_attention_heads" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return fields


# Parameters of an MoE block, which transformers saves in Mixtral's original per-expert layout.
_MOE_PARAMETER = re.compile(r"(.*)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def mixtral_saved_layout(name: str, num_experts: int) -> str | list[list[str]] | None:
    """Where a saved Mixtral checkpoint keeps parameter `name`: the name of the tensor it is (the
    router), the tensors, per expert, whose concatenation is that expert's slice (w1 and w3 make
    gate_up_proj, w2 down_proj), or None for a parameter saved under its own name."""
    match = _MOE_PARAMETER.match(name)
    if match is None:
        return None
    block, parameter = f"{match[1]}.block_sparse_moe", match[2]
    if parameter == "gate.weight":
        return f"{block}.gate.weight"
    parts = ("w1", "w3") if parameter == "experts.gate_up_proj" else ("w2",)
    return [[f"{block}.experts.{e}.{part}.weight" for part in parts] for e in range(num_experts)]


def to_hf(model: LLMStackForCausalLM, family: str) -> PreTrainedModel:
    """The stock `family` model computing what `model` computes (same dtype)."""
    return copy_weights(model, FAMILIES[family].model_class(to_hf_config(model.config, family)), family)


def copy_weights(model: PreTrainedModel, hf: PreTrainedModel, family: str) -> PreTrainedModel:
    """`hf` (a freshly built stock model of the same names) in `model`'s dtype, with `model`'s
    weights. Projection biases llmstack's model lacks (Qwen2's q/k/v, EuroBERT's o_proj) are zero."""
    hf = hf.to(model.dtype)  # type: ignore[arg-type]  # transformers mistypes its wrapped .to()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or any(not name.endswith("_proj.bias") for name in set(missing) - tied):
        raise ValueError(f"{family} model does not match: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name in set(missing) - tied:
            hf.get_parameter(name).zero_()
    return hf


def from_hf(hf_model: PreTrainedModel) -> LLMStackForCausalLM:
    """The llmstack model of a stock Llama, Mistral, Qwen2 or Mixtral causal LM (same weights and dtype)."""
    model = LLMStackForCausalLM(from_hf_config(hf_model.config)).to(hf_model.dtype)  # type: ignore[arg-type]
    model.load_state_dict(hf_model.state_dict(), strict=True)
    return model


def to_llama(model: LLMStackForCausalLM) -> LlamaForCausalLM:
    return cast(LlamaForCausalLM, to_hf(model, "llama"))


from_llama = from_hf
