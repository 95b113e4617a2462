"""Configuration of the llmstack decoder-only Transformer."""

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PretrainedConfig

from .rope import ROPE_TYPES
from .sparse_attention import BigBirdPattern

NORM_POSITIONS = ("pre", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")
INIT_METHODS = ("scaled_normal", "xavier")
ACTIVATIONS = ("swiglu", "gelu")
ATTENTION_PATTERNS = ("dense", "bigbird")


class LLMStackConfig(PretrainedConfig):
    """Hugging Face config with Llama's field names plus llmstack's architecture options.

    norm_position: "pre" (RMSNorm before each sub-layer, the default) or "post" (Post-LN, as in
        the original Transformer: the norm is applied after the residual add).
    init_method: "scaled_normal" (N(0, initializer_range), output projections scaled by
        1/sqrt(2 * num_layers) as in GPT-2/Megatron) or "xavier" (Xavier-uniform).
    activation: "swiglu" (gated SiLU MLP, Llama) or "gelu" (two-matrix GELU MLP, GPT).
    z_loss: coefficient of the PaLM z-loss (mean of log(Z)^2); 0 disables it.
    focal_gamma: focal loss exponent, each token's loss weighted by (1 - p_target)^focal_gamma;
        0 is plain cross entropy (see llmstack.models.loss).
    head_dim: width of an attention head; hidden_size // num_attention_heads when None.
    rope_parameters: RoPE variant in transformers' format, {"rope_type": one of ROPE_TYPES, and that
        type's keys (factor, original_max_position_embeddings, ...)}; None: plain RoPE with rope_theta.
    sliding_window: attention span (in keys, the query's own included) of "sliding_attention"
        layers, as in Mistral and Qwen2; None: every layer attends to the whole causal prefix.
    layer_types: per layer "full_attention" or "sliding_attention"; None: every layer slides when
        sliding_window is set.
    qkv_bias: biases on the query, key and value projections (Qwen2).
    attention_pattern: "dense" (every causal key) or "bigbird" (block-sparse: a local window, global
        blocks and random blocks; see llmstack.models.sparse_attention), with sparse_block_size
        (tokens per block), sparse_window_blocks (earlier blocks read besides the query's own),
        sparse_global_blocks (leading blocks every query reads), sparse_random_blocks (further
        earlier blocks per query block, drawn once per layer from sparse_seed).

    Mixture of experts (llmstack.models.moe; Mixtral's field names where Mixtral has one):
    num_local_experts: routed experts per MoE layer; 0 (the default) keeps every MLP dense.
    num_experts_per_tok: experts each token is routed to (top-k).
    moe_layers: indices of the layers whose MLP is an MoE block; None: every layer.
    moe_intermediate_size: width of one expert; None: intermediate_size.
    moe_shared_intermediate_size: width of an always-on shared expert added to each MoE block; 0: none.
    moe_norm_topk_prob: renormalize the k routing weights to sum to 1 (Mixtral).
    moe_capacity_factor: None (dropless) or c: in training an expert takes at most
        ceil(c x tokens x k / experts) assignments per forward pass, the rest are dropped.
    router_aux_loss_coef: coefficient of the load-balancing loss added to the model's loss.
    router_z_loss_coef: coefficient of the router z-loss added to the model's loss.

    mup_base_width: None (standard parametrisation) or the hidden_size of the base model whose
        hyperparameters transfer: µP's initialisation, attention and output multipliers, and (in
        training) per-parameter learning rates for width multiplier hidden_size / mup_base_width
        (llmstack.models.mup, docs/mup.md). Needs init_method scaled_normal. A base wider than
        the model (m < 1) is allowed; equal to hidden_size it is standard parametrisation exactly.
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
        focal_gamma: float = 0.0,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = 0,
        pad_token_id: int | None = None,
        head_dim: int | None = None,
        rope_parameters: Mapping[str, Any] | None = None,
        sliding_window: int | None = None,
        layer_types: Sequence[str] | None = None,
        qkv_bias: bool = False,
        attention_pattern: str = "dense",
        sparse_block_size: int = 64,
        sparse_window_blocks: int = 1,
        sparse_global_blocks: int = 1,
        sparse_random_blocks: int = 0,
        sparse_seed: int = 0,
        num_local_experts: int = 0,
        num_experts_per_tok: int = 2,
        moe_layers: Sequence[int] | None = None,
        moe_intermediate_size: int | None = None,
        moe_shared_intermediate_size: int = 0,
        moe_norm_topk_prob: bool = True,
        moe_capacity_factor: float | None = None,
        router_aux_loss_coef: float = 0.01,
        router_z_loss_coef: float = 0.0,
        mup_base_width: int | None = None,
        **kwargs: Any,
    ) -> None:
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        _check_choice("norm_position", norm_position, NORM_POSITIONS)
        _check_choice("init_method", init_method, INIT_METHODS)
        _check_choice("activation", activation, ACTIVATIONS)
        _check_sparse_fields(
            attention_pattern,
            sliding_window,
            sparse_block_size,
            sparse_window_blocks,
            sparse_global_blocks,
            sparse_random_blocks,
        )
        _check_moe(num_local_experts, num_experts_per_tok, moe_layers, num_hidden_layers, moe_capacity_factor)
        _check_mup(mup_base_width, init_method)
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
        self.focal_gamma = focal_gamma
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.qkv_bias = qkv_bias
        self.attention_pattern = attention_pattern
        self.sparse_block_size = sparse_block_size
        self.sparse_window_blocks = sparse_window_blocks
        self.sparse_global_blocks = sparse_global_blocks
        self.sparse_random_blocks = sparse_random_blocks
        self.sparse_seed = sparse_seed
        self.num_local_experts = num_local_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_layers = list(moe_layers) if moe_layers is not None else None
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.moe_shared_intermediate_size = moe_shared_intermediate_size
        self.moe_norm_topk_prob = moe_norm_topk_prob
        self.moe_capacity_factor = moe_capacity_factor
        self.router_aux_loss_coef = router_aux_loss_coef
        self.router_z_loss_coef = router_z_loss_coef
        self.mup_base_width = mup_base_width
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


def _check_sparse_fields(
    pattern: str,
    sliding_window: int | None,
    block_size: int,
    window_blocks: int,
    global_blocks: int,
    random_blocks: int,
) -> None:
    _check_choice("attention_pattern", pattern, ATTENTION_PATTERNS)
    if pattern == "dense":
        return
    if sliding_window is not None:
        raise ValueError("attention_pattern bigbird has its own local window: leave sliding_window unset")
    BigBirdPattern(block_size, window_blocks, global_blocks, random_blocks)  # checks the sizes


def _check_moe(
    num_experts: int, top_k: int, moe_layers: Sequence[int] | None, num_layers: int, capacity_factor: float | None
) -> None:
    if not num_experts:
        return
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and num_local_experts ({num_experts})")
    if moe_layers is not None and any(not 0 <= i < num_layers for i in moe_layers):
        raise ValueError(f"moe_layers {list(moe_layers)} must be layer indices below num_hidden_layers ({num_layers})")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"moe_capacity_factor must be positive (or None for dropless routing); got {capacity_factor}")


def _check_mup(base_width: int | None, init_method: str) -> None:
    if base_width is None:
        return
    if isinstance(base_width, bool) or not isinstance(base_width, int) or base_width <= 0:
        raise ValueError(f"mup_base_width must be a positive integer (a hidden_size) or None; got {base_width!r}")
    if init_method != "scaled_normal":
        raise ValueError(
            f"mup_base_width needs init_method scaled_normal (µP scales its normal init); got {init_method!r}"
        )


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
