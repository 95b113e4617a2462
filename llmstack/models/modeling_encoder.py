"""The llmstack bidirectional encoder with a masked-LM head (BERT's objective, Llama's blocks).

The decoder's own layers (modeling_llmstack) with `config.causal` False: attention sees the whole
sequence (padding excepted). The head maps the final norm's output straight to the vocabulary,
tied to the embeddings by default, as EuroBERT does, so a pre-LN SwiGLU encoder converts to the
stock `EuroBertForMaskedLM` (llmstack.models.encoder_interop).
"""

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_encoder import LLMStackEncoderConfig
from .configuration_llmstack import LLMStackConfig
from .configuration_t5 import LLMStackT5Config
from .embedding import LLMStackEmbeddingConfig, LLMStackForEmbedding
from .modeling_llmstack import LLMStackForCausalLM, LLMStackModel, LLMStackPreTrainedModel
from .modeling_t5 import LLMStackForSpanCorruption
from .multitask import LLMStackForMultitask, LLMStackMultitaskConfig


class LLMStackEncoderModel(LLMStackModel):
    """The encoder body: token embeddings, bidirectional layers, final norm."""

    config_class = LLMStackEncoderConfig  # type: ignore[assignment]  # a subclass whose __init__ differs


class LLMStackForMaskedLM(LLMStackPreTrainedModel):
    config_class = LLMStackEncoderConfig  # type: ignore[assignment]  # a subclass whose __init__ differs
    config: LLMStackEncoderConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LLMStackEncoderConfig) -> None:
        super().__init__(config)
        self.model = LLMStackEncoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> MaskedLMOutput:
        """`labels` are aligned with input_ids (IGNORE_INDEX where nothing is scored: every position
        the masking did not select). The loss is the summed cross entropy of the scored positions
        divided by `num_items_in_batch`, by default their number (see llmstack.models.loss).
        `document_ids` with `position_ids`: a packed sequence's documents, each attending to
        itself only (bidirectionally)."""
        hidden = self.model(input_ids, attention_mask, position_ids, None, inputs_embeds, None, document_ids)
        # Labels aligned with the logits: the causal loss is the plain token loss here.
        loss, logits = self.head_and_loss(hidden, labels, num_items_in_batch)
        return MaskedLMOutput(loss=loss, logits=logits)


def model_for(config: LLMStackConfig) -> LLMStackPreTrainedModel:
    """A freshly initialised model of `config`: the encoder for an encoder's config, the embedding
    model for an embedding model's, the multi-task model for a multi-task one, the encoder-decoder
    for its config, else the decoder."""
    if isinstance(config, LLMStackEmbeddingConfig):
        return LLMStackForEmbedding(config)
    if isinstance(config, LLMStackMultitaskConfig):
        return LLMStackForMultitask(config)
    if isinstance(config, LLMStackT5Config):
        return LLMStackForSpanCorruption(config)
    return LLMStackForMaskedLM(config) if isinstance(config, LLMStackEncoderConfig) else LLMStackForCausalLM(config)


__all__ = ["LLMStackEncoderModel", "LLMStackForMaskedLM", "model_for"]
