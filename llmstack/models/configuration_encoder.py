"""Configuration of the llmstack bidirectional encoder (masked-LM pretraining)."""

from typing import Any

from .configuration_llmstack import LLMStackConfig


class LLMStackEncoderConfig(LLMStackConfig):
    """LLMStackConfig for an encoder: the same blocks with attention over the whole sequence.

    mask_token_id: the tokenizer's mask token, which the masked-LM objective puts in place of
        most selected tokens (`llmstack data train-tokenizer --encoder-tokens` adds one).

    Sliding-window attention is causal by construction and is refused; BigBird attention
    (`attention_pattern: bigbird`) runs its bidirectional pattern, global blocks reading the whole
    sequence; every other architecture option means what it means for the decoder.
    """

    model_type = "llmstack_encoder"
    causal = False

    def __init__(self, mask_token_id: int | None = None, **kwargs: Any) -> None:
        if kwargs.get("sliding_window") is not None:
            raise ValueError("sliding_window is a causal (decoder) option; an encoder attends to the whole sequence")
        if kwargs.get("num_local_experts"):
            raise ValueError("mixture of experts is wired into the decoder only; an encoder's MLPs are dense")
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)
