"""Conversion of llmstack encoder-decoders to the stock transformers `T5ForConditionalGeneration`.

The llmstack model is T5 v1.1's layout (llmstack.models.modeling_t5): `feed_forward_proj:
gated-silu` (llmstack's SwiGLU MLP), untied head without the decoder-output scaling, relative
position bias in each stack's first block. Only the parameter names differ; `t5_name` maps them.
"""

import re

from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from .configuration_t5 import LLMStackT5Config
from .modeling_t5 import LLMStackForSpanCorruption

T5_FAMILIES = ("t5",)
# llmstack name pattern -> T5's (stack, block and the sub-layer's index in T5's block).
_ATTENTION = r"\.([qkvo])_proj\.weight"
_BLOCK_NAMES = {
    r"(encoder|decoder)\.layers\.(\d+)\.input_layernorm\.weight": r"\1.block.\2.layer.0.layer_norm.weight",
    r"(encoder|decoder)\.layers\.(\d+)\.self_attn" + _ATTENTION: r"\1.block.\2.layer.0.SelfAttention.\3.weight",
    r"decoder\.layers\.(\d+)\.cross_attention_layernorm\.weight": r"decoder.block.\1.layer.1.layer_norm.weight",
    r"decoder\.layers\.(\d+)\.cross_attn" + _ATTENTION: r"decoder.block.\1.layer.1.EncDecAttention.\2.weight",
    r"encoder\.layers\.(\d+)\.post_attention_layernorm\.weight": r"encoder.block.\1.layer.1.layer_norm.weight",
    r"decoder\.layers\.(\d+)\.post_attention_layernorm\.weight": r"decoder.block.\1.layer.2.layer_norm.weight",
    r"encoder\.layers\.(\d+)\.mlp\.": r"encoder.block.\1.layer.1.DenseReluDense.",
    r"decoder\.layers\.(\d+)\.mlp\.": r"decoder.block.\1.layer.2.DenseReluDense.",
    r"(encoder|decoder)\.relative_bias\.embedding\.weight": (
        r"\1.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    ),
    r"(encoder|decoder)\.norm\.weight": r"\1.final_layer_norm.weight",
}
_MLP_NAMES = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}


def t5_name(name: str) -> str:
    """The stock T5 parameter name of an llmstack encoder-decoder's parameter `name`."""
    for pattern, replacement in _BLOCK_NAMES.items():
        renamed, found = re.subn(f"^{pattern}", replacement, name)
        if found:
            return re.sub(r"DenseReluDense\.(\w+)", lambda m: f"DenseReluDense.{_MLP_NAMES[m.group(1)]}", renamed)
    return name  # shared.weight, lm_head.weight


def to_t5_config(config: LLMStackT5Config) -> T5Config:
    """The stock T5Config of an llmstack encoder-decoder's config (T5 v1.1's gated-silu layout)."""
    return T5Config(  # type: ignore[call-arg]  # the token ids and tying are PretrainedConfig's keywords
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        d_kv=config.head_dim,
        d_ff=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_decoder_layers=config.num_decoder_layers,
        num_heads=config.num_attention_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=0.0,
        layer_norm_epsilon=config.rms_norm_eps,
        feed_forward_proj="gated-silu",
        tie_word_embeddings=False,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def to_t5(model: LLMStackForSpanCorruption) -> T5ForConditionalGeneration:
    """The stock `T5ForConditionalGeneration` computing what `model` computes (same dtype)."""
    hf = T5ForConditionalGeneration(to_t5_config(model.config)).to(model.dtype)  # type: ignore[arg-type]
    # Stock T5 ties its head to `shared` when built (transformers 5 forces tie_word_embeddings) and
    # unties it when loading a checkpoint that holds a different head, as v1.1 checkpoints do.
    hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone())
    hf.all_tied_weights_keys.pop("lm_head.weight", None)
    weights = {t5_name(name): tensor for name, tensor in model.state_dict().items()}
    # T5 keeps the shared embedding under each stack's name too (tied to `shared`).
    weights |= {f"{stack}.embed_tokens.weight": weights["shared.weight"] for stack in ("encoder", "decoder")}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"t5 model does not match: missing {missing}, unexpected {unexpected}")
    return hf
