"""Using a trained model: generation with a KV cache and sampling. Nothing here imports training."""

from .generate import generate, generate_text
from .sampling import GREEDY, SamplingParams

__all__ = ["GREEDY", "SamplingParams", "generate", "generate_text"]
