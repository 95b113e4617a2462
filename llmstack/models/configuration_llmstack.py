"""Configuration of the llmstack decoder-only Transformer."""

from transformers import PretrainedConfig

NORM_POSITIONS = ("pre", "post")
INIT_METHODS = ("scaled_normal", "xavier")
ACTIVATIONS = ("swiglu", "gelu")


class LLMStackConfig(PretrainedConfig):
    """Hugging Face config with Llama's field names plus llmstack's architecture options.

    norm_position: "pre" (RMSNorm before each sub-layer, the default) or "post" (Post-LN, as in
        the original Transformer: the norm is applied after the residual add).
    init_method: "scaled_normal" (N(0, initializer_range), output projections scaled by
        1/sqrt(2 * num_layers) as in GPT-2/Megatron) or "xavier" (Xavier-uniform).
    activation: "swiglu" (gated SiLU MLP, Llama) or "gelu" (two-matrix GELU MLP, GPT).
    z_loss: coefficient of the PaLM z-loss (mean of log(Z)^2); 0 disables it.
    """

    model_type = "llmstack"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=None,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        norm_position="pre",
        init_method="scaled_normal",
        initializer_range=0.02,
        activation="swiglu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        label_smoothing=0.0,
        z_loss=0.0,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=None,
        **kwargs,
    ):
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_choice("init_method", init_method, INIT_METHODS)
        _check_choice("activation", activation, ACTIVATIONS)
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads})"
            )
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({num_key_value_heads})"
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.norm_position = norm_position
        self.init_method = init_method
        self.initializer_range = initializer_range
        self.activation = activation
        self.hidden_dropout = hidden_dropout
        self.attention_dropout = attention_dropout
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
