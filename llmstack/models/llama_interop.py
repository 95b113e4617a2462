"""Conversion between llmstack models and Hugging Face `LlamaForCausalLM`.

llmstack's parameter names are Llama's, so the state dict passes through unchanged; only the
config is translated. Only pre-LN SwiGLU models have a Llama equivalent.
"""

from transformers import LlamaConfig, LlamaForCausalLM

from .configuration_llmstack import LLMStackConfig
from .modeling_llmstack import LLMStackForCausalLM

# Fields with the same name and meaning in both configs.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def shared_fields(config):
    return {name: getattr(config, name) for name in SHARED_FIELDS}


def to_llama_config(config: LLMStackConfig) -> LlamaConfig:
    if config.norm_position != "pre" or config.activation != "swiglu":
        raise ValueError(
            "only pre-LN SwiGLU models have a Llama equivalent; this model has "
            f"norm_position={config.norm_position!r}, activation={config.activation!r}. "
            "Export it with --format llmstack instead."
        )
    return LlamaConfig(
        **shared_fields(config),
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


def from_llama_config(config: LlamaConfig) -> LLMStackConfig:
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("Llama checkpoints with attention or MLP biases are not supported")
    if config.hidden_act != "silu":
        raise ValueError(f"expected a SiLU-gated Llama MLP; got hidden_act={config.hidden_act!r}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported; only default RoPE is")
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim != config.hidden_size // config.num_attention_heads:
        raise ValueError("Llama checkpoints with a non-standard head_dim are not supported")
    return LLMStackConfig(**shared_fields(config), rope_theta=rope.get("rope_theta", 10000.0))


def to_llama(model: LLMStackForCausalLM) -> LlamaForCausalLM:
    llama = LlamaForCausalLM(to_llama_config(model.config)).to(model.dtype)
    llama.load_state_dict(model.state_dict(), strict=True)
    return llama


def from_llama(llama: LlamaForCausalLM) -> LLMStackForCausalLM:
    model = LLMStackForCausalLM(from_llama_config(llama.config)).to(llama.dtype)
    model.load_state_dict(llama.state_dict(), strict=True)
    return model
