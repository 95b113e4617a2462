"""Conversion of llmstack encoders to the stock transformers `EuroBertForMaskedLM`.

EuroBERT is Llama's pre-LN block (RMSNorm, RoPE, grouped-query attention, SiLU-gated MLP) with
bidirectional attention and a vocabulary head straight after the final norm: an llmstack encoder
with those options has the same parameter names and computes the same logits. q/k/v biases map
to EuroBERT's attention_bias with a zero o_proj bias.
"""

from transformers import EuroBertConfig, EuroBertForMaskedLM

from .configuration_encoder import LLMStackEncoderConfig
from .hf_interop import SHARED_FIELDS, check_standard_parametrisation, copy_weights
from .modeling_encoder import LLMStackForMaskedLM

ENCODER_FAMILIES = ("eurobert",)


def to_eurobert_config(config: LLMStackEncoderConfig) -> EuroBertConfig:
    """The stock EuroBERT config of an llmstack encoder config; ValueError naming what it lacks."""
    if config.norm_position != "pre" or config.activation != "swiglu":
        raise ValueError(
            "only pre-LN SwiGLU encoders have a eurobert equivalent; this model has "
            f"norm_position={config.norm_position!r}, activation={config.activation!r}. "
            "Export it with --format llmstack instead."
        )
    if config.attention_pattern != "dense":
        raise ValueError("eurobert has no sparse attention (attention_pattern bigbird); export with --format llmstack")
    check_standard_parametrisation(config, "eurobert")
    if config.mask_token_id is None:
        raise ValueError("eurobert needs the mask token's id; set model.mask_token_id")
    return EuroBertConfig(
        **{name: getattr(config, name) for name in SHARED_FIELDS},
        rope_parameters=dict(config.rope_parameters),
        hidden_act="silu",
        attention_bias=config.qkv_bias,
        mlp_bias=False,
        mask_token_id=config.mask_token_id,
    )


def to_eurobert(model: LLMStackForMaskedLM) -> EuroBertForMaskedLM:
    """The stock `EuroBertForMaskedLM` computing what `model` computes (same dtype)."""
    hf = copy_weights(model, EuroBertForMaskedLM(to_eurobert_config(model.config)), "eurobert")
    assert isinstance(hf, EuroBertForMaskedLM)
    return hf
