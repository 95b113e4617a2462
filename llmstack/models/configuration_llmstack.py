"""Configuration of the llmstack decoder-only Transformer."""

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PretrainedConfig

from .rope import ROPE_TYPES

NORM_POSITIONS = ("pre", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")
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
    head_dim: width of an attention head; hidden_size // num_attention_heads when None.
    rope_parameters: RoPE variant in transformers' format, {"rope_type": one of ROPE_TYPES, and that
        type's keys (factor, original_max_position_embeddings, ...)}; None: plain RoPE with rope_theta.
    sliding_window: attention span (in keys, the query's own included) of "sliding_attention"
        layers, as in Mistral and Qwen2; None: every layer attends to the whole causal prefix.
    layer_types: per layer "full_attention" or "sliding_attention"; None: every layer slides when
        sliding_window is set.
    qkv_bias: biases on the query, key and value projections (Qwen2).
    """

    model_type = "llmstack"
    keys_to_ignore_at_inference = ["past_key_values"]
    causal = True  # attention sees only earlier positions; the encoder's config (modeling_encoder) says False

    def __init__(
        self,
        vocab_size: int = 8192,
        hidden_size: int = 384,
        intermediate_size: int = 1024,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 6,
        num_key_value_heads: int | None = None,
        max_position_embeddings: int = 1024,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        tie_word_embeddings: bool = True,
        norm_position: str = "pre",
        init_method: str = "scaled_normal",
        initializer_range: float = 0.02,
        activation: str = "swiglu",
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = 0,
        pad_token_id: int | None = None,
        head_dim: int | None = None,
        rope_parameters: Mapping[str, Any] | None = None,
        sliding_window: int | None = None,
        layer_types: Sequence[str] | None = None,
        qkv_bias: bool = False,
        **kwargs: Any,
    ) -> None:
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_choice("init_method", init_method, INIT_METHODS)
        _check_choice("activation", activation, ACTIVATIONS)
        if head_dim is None and hidden_size % num_attention_heads:
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
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.qkv_bias = qkv_bias
        self.sliding_window = sliding_window
        self.layer_types = _layer_types(layer_types, sliding_window, num_hidden_layers)
        # transformers standardizes this dict in super().__init__ (adds rope_theta, rope_type and
        # original_max_position_embeddings where the type needs it).
        self.rope_parameters = dict(rope_parameters) if rope_parameters else None
        # The runtime __init__ takes every dataclass field as a keyword (strict(accept_kwargs=True));
        # mypy sees only the base class's own fields.
        super().__init__(  # type: ignore[call-arg]
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.rope_theta = self.rope_parameters["rope_theta"]
        _check_choice("rope_parameters.rope_type", self.rope_parameters["rope_type"], ROPE_TYPES)
        if self.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope_parameters.partial_rotary_factor != 1 (partial rotary embeddings) is not supported")


def _layer_types(layer_types: Sequence[str] | None, sliding_window: int | None, num_layers: int) -> list[str] | None:
    if layer_types is None:
        return None
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    for kind in layer_types:
        _check_choice("layer_types entries", kind, LAYER_TYPES)
    if sliding_window is None and "sliding_attention" in layer_types:
        raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
    return layer_types


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
