"""Configuration of the llmstack encoder-decoder (T5 v1.1's layout, span-corruption pretraining)."""

from typing import Any

from .configuration_llmstack import LLMStackConfig


class LLMStackT5Config(LLMStackConfig):
    """LLMStackConfig for an encoder-decoder: num_hidden_layers encoder blocks and
    num_decoder_layers decoder blocks of pre-LN RMSNorm, attention and a SwiGLU MLP, as T5 v1.1.

    Positions are T5's relative position bias (no RoPE): relative_attention_num_buckets buckets,
    logarithmic up to relative_attention_max_distance tokens, learnt per head in the first block
    of each stack and added in every block. The decoder starts from the pad token
    (decoder_start_token_id), as T5's does. Options of the decoder-only model that T5 has no
    counterpart for (post-LN, GELU, sliding windows, BigBird, experts, µP, biases) and dropout (T5 v1.1
    pretrains without it) are refused.
    """

    model_type = "llmstack_t5"
    causal = False

    def __init__(
        self,
        num_decoder_layers: int | None = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        **kwargs: Any,
    ) -> None:
        refused = {
            "sliding_window": None,
            "num_local_experts": 0,
            "mup_base_width": None,
            "qkv_bias": False,
            "norm_position": "pre",
            "activation": "swiglu",
            "attention_pattern": "dense",
            "hidden_dropout": 0.0,  # T5 v1.1 pretrains without dropout
            "attention_dropout": 0.0,
        }
        for name, default in refused.items():
            if kwargs.get(name, default) != default:
                raise ValueError(
                    f"{name}={kwargs[name]!r} has no T5 v1.1 counterpart; the encoder-decoder takes {name}={default!r}"
                )
        kwargs.setdefault("tie_word_embeddings", False)  # T5 v1.1 unties the head from the embeddings
        kwargs.setdefault("rms_norm_eps", 1e-6)
        super().__init__(**kwargs)
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: the encoder-decoder's head is untied (T5 v1.1); set it false")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("the encoder-decoder's attention has as many key/value heads as query heads (T5)")
        self.num_decoder_layers = num_decoder_layers or self.num_hidden_layers
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.is_encoder_decoder = True
        self.decoder_start_token_id = self.pad_token_id
