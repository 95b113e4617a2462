"""µP, the maximal update parametrization (Yang et al., Tensor Programs V, arXiv 2203.03466), for
AdamW, as `LLMStackConfig.mup_base_width` switches it on (see docs/mup.md).

With width multiplier m = hidden_size / mup_base_width, by kind of parameter:

    hidden weights (q/k/v/o, MLP and expert matrices)   init std / sqrt(m)   Adam lr / m
    MoE router (a readout without a multiplier)         init std / m         Adam lr / m
    token embedding, lm_head (tied or not)              init std             Adam lr
    norm gains, biases                                  init as usual        Adam lr

and the logits are multiplied by 1/m (the output multiplier, applied to the final hidden states,
so a tied embedding stays an input weight), the attention scores by 1/sqrt(m) on top of
1/sqrt(head_dim) (µP's 1/head_dim rule for heads that widen with the model). At m = 1 every
factor is 1: the model is the standard-parametrised one. The initialisation, the attention and
output multipliers are the model's (modeling_llmstack); the learning rates are the optimizer's
(llmstack.training.trainer.param_groups, from `lr_scale`).
"""

from .configuration_llmstack import LLMStackConfig

# Modules whose weights keep the base learning rate: the embedding and the readout (under the
# output multiplier), and adapters (LoRA matrices have a fixed rank, not a width).
UNSCALED_MODULES = ("embed_tokens", "lm_head", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def width_multiplier(config: LLMStackConfig) -> float:
    """m = hidden_size / mup_base_width; 1.0 under standard parametrisation (mup_base_width None)."""
    base = config.mup_base_width
    return 1.0 if base is None else config.hidden_size / base


def lr_scale(name: str, ndim: int, config: LLMStackConfig) -> float:
    """The factor on the base Adam learning rate of the parameter `name` (of the plain model, or
    with a wrapper's prefix or infix) of `ndim` dimensions: 1/m for hidden weights and the router,
    1 for everything else."""
    m = width_multiplier(config)
    if m == 1.0 or ndim < 2 or any(part in UNSCALED_MODULES for part in name.split(".")):
        return 1.0
    return 1.0 / m
