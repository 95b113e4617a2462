"""The llmstack encoder-decoder, in one file: T5 v1.1 built from llmstack's layers.

Each stack is pre-LN blocks (RMSNorm without mean, as T5's layer norm) of attention and llmstack's
SwiGLU MLP: T5's `feed_forward_proj: gated-silu` (wi_0 = gate_proj, wi_1 = up_proj, wo =
down_proj). Attention has no 1/sqrt(head_dim) scaling (T5 folds it into the initialisation) and
adds a learnt relative position bias, bucketed by distance: bidirectional in the encoder, causal
in the decoder, computed by the first block of each stack and added in every block. Decoder
blocks read the encoder's output by cross attention. The embedding is shared by the two stacks,
the head is untied and no scaling precedes it (v1.1), and the decoder starts from the pad token.
So an llmstack encoder-decoder converts to the stock `T5ForConditionalGeneration` exactly
(llmstack.models.t5_interop), which also serves generation.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import Seq2SeqLMOutput

from llmstack.compat.transformers import checkpointed_call

from .configuration_t5 import LLMStackT5Config
from .loss import IGNORE_INDEX, causal_lm_loss, tally_spans, tallying_predictions
from .modeling_llmstack import LLMStackPreTrainedModel, RMSNorm, SwiGLU


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each (key position - query position): half the buckets are exact distances,
    the other half logarithmically wider up to `max_distance`; bidirectional halves the buckets
    again between keys before and after the query, causal counts only keys before it."""
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        buckets //= 2
        bucket += (relative_position > 0).long() * buckets
        distance = relative_position.abs()
    else:
        distance = -relative_position.clamp_max(0)
    max_exact = buckets // 2
    large = (
        max_exact
        + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (buckets - max_exact)).long()
    )
    return bucket + torch.where(distance < max_exact, distance, large.clamp_max(buckets - 1))


class RelativePositionBias(nn.Module):
    """A learnt bias per head and distance bucket, (1, heads, queries, keys), added to the scores."""

    def __init__(self, config: LLMStackT5Config, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.embedding = nn.Embedding(self.buckets, config.num_attention_heads)

    def forward(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        relative = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        bucket = relative_position_bucket(relative, self.bidirectional, self.buckets, self.max_distance)
        return self.embedding(bucket).permute(2, 0, 1).unsqueeze(0)


class T5Attention(nn.Module):
    """Multi-head attention without score scaling; the additive `bias` carries positions and masks."""

    def __init__(self, config: LLMStackT5Config) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        inner = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.o_proj.is_residual_output = True  # type: ignore[assignment]  # read by the weight init

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        """Self attention of x, or (with `memory`, the encoder's output) cross attention to it."""
        batch, seq, _ = x.shape
        source = x if memory is None else memory
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(source).view(batch, source.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(source).view(batch, source.shape[1], -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=1.0)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class T5Block(nn.Module):
    """Pre-LN self attention, cross attention (decoder blocks only) and SwiGLU MLP, each residual."""

    def __init__(self, config: LLMStackT5Config, decoder: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = T5Attention(config)
        if decoder:
            self.cross_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.cross_attn = T5Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor,
        memory: torch.Tensor | None = None,
        memory_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), bias)
        if memory is not None:
            assert memory_bias is not None  # the encoder's padding mask, with the memory
            x = x + self.cross_attn(self.cross_attention_layernorm(x), memory_bias, memory)
        return x + self.mlp(self.post_attention_layernorm(x))


class T5Stack(nn.Module):
    """The encoder's (bidirectional) or the decoder's (causal, cross-attending) blocks, the relative
    position bias they share, and the final norm."""

    def __init__(self, config: LLMStackT5Config, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        layers = config.num_decoder_layers if decoder else config.num_hidden_layers
        self.layers = nn.ModuleList(T5Block(config, decoder) for _ in range(layers))
        self.relative_bias = RelativePositionBias(config, bidirectional=not decoder)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False  # transformers' activation_checkpointing_enable sets it

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        seq = x.shape[1]
        bias = self.relative_bias(seq, seq, x.device).to(x.dtype)
        if self.decoder:
            future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            bias = bias.masked_fill(future, torch.finfo(x.dtype).min)
        bias = bias + padding_bias(attention_mask, x.dtype)
        memory_bias = None
        if memory is not None:
            memory_bias = padding_bias(memory_mask, x.dtype).expand(x.shape[0], 1, seq, memory.shape[1])
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpointed_call(self, layer.__call__, x, bias, memory, memory_bias)
            else:
                x = layer(x, bias, memory, memory_bias)
        return self.norm(x)


def padding_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(batch, 1, 1, keys) additive bias: 0 at tokens, the dtype's minimum at padding (mask 0)."""
    if mask is None:
        return torch.zeros((), dtype=dtype)
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def shift_right(labels: torch.Tensor, start_token_id: int, pad_token_id: int) -> torch.Tensor:
    """The decoder's inputs for `labels`: the start token, then each label but the last (teacher
    forcing); IGNORE_INDEX labels become padding."""
    shifted = labels.new_full(labels.shape, start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad_token_id)


class LLMStackForSpanCorruption(LLMStackPreTrainedModel):
    """The encoder-decoder with its vocabulary head, trained on T5's span corruption."""

    config_class = LLMStackT5Config  # type: ignore[assignment]  # a subclass whose __init__ differs
    config: LLMStackT5Config
    _no_split_modules = ["T5Block"]

    def __init__(self, config: LLMStackT5Config) -> None:
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder = T5Stack(config, decoder=False)
        self.decoder = T5Stack(config, decoder=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.shared

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's final hidden states."""
        return self.encoder(self.shared(input_ids), attention_mask)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        span_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Seq2SeqLMOutput:
        """As T5ForConditionalGeneration: `labels` are the decoder's targets (IGNORE_INDEX where
        not scored), its inputs `decoder_input_ids` by default the labels shifted right behind the
        start token. The loss is the summed token loss divided by `num_items_in_batch` (default:
        the scored targets). `span_ids` (llmstack.data.span_corruption): each target's masked span
        (-1: none), for the exact-span accuracy counted under `tallying_predictions`."""
        if encoder_hidden_states is None:
            assert input_ids is not None  # the encoder's inputs, or its output
            encoder_hidden_states = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            assert labels is not None  # teacher forcing needs targets
            decoder_input_ids = shift_right(labels, self.config.decoder_start_token_id, self.config.pad_token_id)  # type: ignore[assignment]
        hidden = self.decoder(
            self.shared(decoder_input_ids), decoder_attention_mask, encoder_hidden_states, attention_mask
        )
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            with tallying_predictions():  # token accuracy is not reported: spans are (below)
                loss = causal_lm_loss(logits, labels, num_items_in_batch=num_items_in_batch, **self.loss_options())
            if span_ids is not None:
                tally_spans(logits, labels, span_ids)
        return Seq2SeqLMOutput(loss=loss, logits=logits, encoder_last_hidden_state=encoder_hidden_states)


__all__ = ["LLMStackForSpanCorruption", "relative_position_bucket", "shift_right"]
