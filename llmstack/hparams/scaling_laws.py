"""Published fits for a compute budget C (FLOPs) of a dense decoder trained on D tokens with N parameters.

- Chinchilla (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models",
  arXiv:2203.15556): C ~ 6ND, and the compute-optimal model sees about 20 tokens per parameter.
- DeepSeek LLM (DeepSeek-AI 2024, arXiv:2401.02954, section 3.1): the near-optimal peak learning
  rate and global batch (in tokens) of AdamW runs, fitted against C = M * D where M is the
  non-embedding FLOPs per token including attention, M = 72 n_layer d_model^2 + 6 n_layer d_model l_seq:
      eta_opt = 0.3118 * C^-0.1250        B_opt = 0.2920 * C^0.3271
  Their runs used a multi-step schedule, AdamW (0.9, 0.95), weight decay 0.1, 4096-token sequences.
"""

import math

TOKENS_PER_PARAMETER = 20.0  # Chinchilla's compute-optimal ratio
DEEPSEEK_LR = (0.3118, -0.1250)  # (coefficient, exponent) of eta_opt(C)
DEEPSEEK_BATCH_TOKENS = (0.2920, 0.3271)  # of B_opt(C), in tokens


def training_flops(params: float, tokens: float) -> float:
    """C ~ 6ND: forward (2ND) and backward (4ND) matmuls, attention ignored."""
    return 6.0 * params * tokens


def compute_optimal(flops: float) -> tuple[float, float]:
    """(parameters, tokens) of the Chinchilla-optimal model for `flops`: D = 20 N with C = 6ND."""
    params = math.sqrt(flops / (6.0 * TOKENS_PER_PARAMETER))
    return params, TOKENS_PER_PARAMETER * params


def deepseek_flops_per_token(layers: int, hidden: int, seq_len: int) -> float:
    """M, DeepSeek LLM's model scale: non-embedding FLOPs per token, attention included."""
    return 72.0 * layers * hidden**2 + 6.0 * layers * hidden * seq_len


def deepseek_learning_rate(compute: float) -> float:
    """eta_opt for C = M * D (DeepSeek LLM 2024, eq. 1)."""
    coefficient, exponent = DEEPSEEK_LR
    return coefficient * compute**exponent


def deepseek_batch_tokens(compute: float) -> float:
    """B_opt in tokens for C = M * D (DeepSeek LLM 2024, eq. 1)."""
    coefficient, exponent = DEEPSEEK_BATCH_TOKENS
    return coefficient * compute**exponent
