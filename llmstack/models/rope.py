"""Rotary-position frequencies for the RoPE variants of the Llama family.

`rope_frequencies(config, seq_len)` gives (inv_freq, attention_scaling) for the model's
`rope_parameters`, computed as transformers computes them for Llama, so imported checkpoints give
the same logits:

    default   theta^(-2i/d)
    linear    positions interpolated: inv_freq / factor
    dynamic   NTK-aware: theta grows with the sequence once it exceeds max_position_embeddings
    llama3    low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1)
    yarn      interpolation/extrapolation ramp by rotation count, cos/sin scaled by attention_factor

Dynamic scaling is computed from the current sequence length every call; transformers keeps the
largest length seen so far instead, so the two agree while lengths do not shrink back above the
original context.
"""

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .configuration_llmstack import LLMStackConfig

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_frequencies(config: "LLMStackConfig", seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq of length head_dim / 2, factor applied to cos and sin) for `config`'s RoPE at a
    sequence of `seq_len` positions (only "dynamic" depends on it)."""
    params = config.rope_parameters
    theta, dim = params["rope_theta"], config.head_dim
    kind = params["rope_type"]
    if kind == "default":
        return default_inv_freq(theta, dim), 1.0
    if kind == "linear":
        return default_inv_freq(theta, dim) / params["factor"], 1.0
    if kind == "dynamic":
        return _dynamic_ntk(params, theta, dim, config.max_position_embeddings, seq_len), 1.0
    if kind == "llama3":
        return _llama3(params, default_inv_freq(theta, dim)), 1.0
    if kind == "yarn":
        return _yarn(params, theta, dim, config.max_position_embeddings)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def _dynamic_ntk(
    params: Mapping[str, Any], theta: float, dim: int, max_positions: int, seq_len: int | None
) -> torch.Tensor:
    seq_len = max(seq_len or max_positions, max_positions)
    factor = params["factor"]
    theta = theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(theta, dim)


def _llama3(params: Mapping[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(params: Mapping[str, Any], theta: float, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    context = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / context
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
