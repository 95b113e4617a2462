"""The llmstack embedding model: the decoder's trunk with its hidden states pooled into one vector a text.

Pooling is the mean over the text's tokens (padding excluded) or the text's last token, whose
causal hidden state has read the whole text (right padding: the last token that is not padding).
`embed` returns the unit-length embeddings compared by cosine similarity; the trunk's weights
have the decoder's names, so the model exports as a stock Llama trunk
(llmstack.training.export) with sentence-transformers' matching pooling.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from .configuration_llmstack import LLMStackConfig
from .modeling_llmstack import LLMStackModel, LLMStackPreTrainedModel

POOLINGS = ("mean", "last")


class LLMStackEmbeddingConfig(LLMStackConfig):
    """LLMStackConfig of an embedding model. pooling: "mean" or "last" (see POOLINGS)."""

    model_type = "llmstack_embedding"

    def __init__(self, pooling: str = "mean", **kwargs: Any) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
        if kwargs.get("num_local_experts"):
            raise ValueError("mixture of experts is not wired into the embedding model; its MLPs are dense")
        self.pooling = pooling
        super().__init__(**kwargs)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """(batch, hidden) vectors of (batch, seq, hidden) states: the mean over the tokens where
    `attention_mask` is 1, or the last such token's state (right padding; None: no padding)."""
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    if pooling == "mean":
        weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    if pooling == "last":
        last = attention_mask.long().sum(1).clamp(min=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")


@dataclass
class EmbeddingOutput(ModelOutput):
    embeddings: torch.Tensor | None = None  # (batch, hidden), pooled, not normalised


class LLMStackForEmbedding(LLMStackPreTrainedModel):
    config_class = LLMStackEmbeddingConfig  # type: ignore[assignment]  # a subclass whose __init__ differs
    config: LLMStackEmbeddingConfig

    def __init__(self, config: LLMStackEmbeddingConfig) -> None:
        super().__init__(config)
        self.model = LLMStackModel(config)
        self.post_init()

    def forward(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> EmbeddingOutput:
        """Pooled embeddings of right-padded texts (`attention_mask` 1 on tokens, 0 on padding)."""
        hidden = self.model(input_ids, attention_mask)
        return EmbeddingOutput(embeddings=pool(hidden, attention_mask, self.config.pooling))

    def embed(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Unit-length embeddings (what retrieval compares, and sentence-transformers' export returns)."""
        embeddings = self(input_ids, attention_mask).embeddings
        assert embeddings is not None
        return F.normalize(embeddings.float(), dim=-1)


__all__ = ["POOLINGS", "EmbeddingOutput", "LLMStackEmbeddingConfig", "LLMStackForEmbedding", "pool"]
