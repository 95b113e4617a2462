"""Using a trained model: generation with a KV cache, LoRA and prompt tuning, perplexity, SFT data."""

from .generate import generate, generate_text
from .lora import add_lora, add_prompt_tuning, merge_lora
from .perplexity import evaluate_perplexity
from .sampling import GREEDY, SamplingParams

__all__ = [
    "GREEDY",
    "SamplingParams",
    "add_lora",
    "add_prompt_tuning",
    "evaluate_perplexity",
    "generate",
    "generate_text",
    "merge_lora",
]
