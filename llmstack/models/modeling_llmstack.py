"""The llmstack decoder-only Transformer, in one file.

Pre-LN (or Post-LN) blocks of grouped-query attention with rotary positions and a SwiGLU (or GELU)
MLP, RMSNorm, optionally tied embeddings. Parameter names follow Hugging Face's Llama, so a
pre-LN SwiGLU model converts to and from `LlamaForCausalLM` by renaming nothing.

The file is plain PyTorch on purpose: tensor and pipeline parallelism (llmstack.parallel) rewrite
or wrap these modules from outside instead of being woven into them.
"""

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from llmstack.compat.transformers import checkpointed_call, weight_init

from .configuration_llmstack import LLMStackConfig
from .loss import (
    IGNORE_INDEX,
    HeadWithLoss,
    LossOptions,
    causal_lm_loss,
    linear_cross_entropy,
    loss_options,
    next_token_targets,
)
from .moe import (
    Experts,
    MoEBlock,
    MoECausalLMOutputWithPast,
    RouterRecord,
    TopKRouter,
    moe_layer_indices,
    router_token_mask,
)
from .mup import width_multiplier
from .rope import rope_frequencies
from .sparse_attention import BigBirdPattern, decoder_sparse_attention, encoder_sparse_attention

init = weight_init()


def _eager_training(x: torch.Tensor) -> bool:
    """Whether an op on x runs eagerly and will be differentiated: where the hand-written backwards
    below pay. Otherwise the plain formulas run: torch.compile fuses them better, and inference
    (and the ONNX exporter's tracing) needs no backward."""
    return torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling()


class RMSNorm(nn.Module):
    """RMSNorm; `multiplier`, a fixed factor on the output (µP's output multiplier on the final norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, multiplier: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _eager_training(x) and x.dtype == self.weight.dtype == torch.float32:
            out = _RMSNormFP32.apply(x, self.weight, self.eps)
        else:
            dtype = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * x.to(dtype)
        return out if self.multiplier == 1.0 else out * self.multiplier


class Multiplier(nn.Module):
    """A fixed factor (µP's output multiplier where the body ends without a norm: post-LN)."""

    def __init__(self, multiplier: float) -> None:
        super().__init__()
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.multiplier


class _RMSNormFP32(torch.autograd.Function):
    """RMSNorm of fp32 tensors for training, with the closed-form backward (a few passes where
    autograd through the formula takes about ten), saving x and the per-token scale only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x * rstd
        grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
        grad_normed = grad * weight
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
        mean = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).div_(x.shape[-1])
        return torch.addcmul(grad_normed, normed, mean, value=-1).mul_(rstd), grad_weight, None


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary positions, in the half-rotation layout Llama checkpoints use, for
    any of the RoPE variants in llmstack.models.rope."""

    inv_freq: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, config: LLMStackConfig) -> None:
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dynamic = config.rope_parameters["rope_type"] == "dynamic"

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        seq_len = int(position_ids.max()) + 1 if self.dynamic else 0
        if seq_len > self.config.max_position_embeddings:
            inv_freq = rope_frequencies(self.config, seq_len)[0].to(inv_freq.device)
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, head_dim), from RotaryEmbedding."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if _eager_training(x):
        return _Rotary.apply(x, cos, sin)
    return x * cos + rotate_half(x) * sin  # as traced for ONNX export


def _rotate_in_two_passes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin as one product and one fused multiply-add per half, for
    tables whose two halves are equal (RotaryEmbedding's are: the frequencies twice)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


class _Rotary(torch.autograd.Function):
    """Rotary positions for training: two passes forward and two backward (rotating by -angle is
    the transpose), saving only the tables, where autograd through rotate_half takes about ten."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_in_two_passes(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate_in_two_passes(grad, cos, -sin), None, None


class Attention(nn.Module):
    def __init__(self, config: LLMStackConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.causal = config.causal
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dropout = config.attention_dropout
        sliding = config.sliding_window is not None and (
            config.layer_types is None or config.layer_types[layer_idx] == "sliding_attention"
        )
        self.sliding_window = config.sliding_window if sliding else None
        bigbird = config.attention_pattern == "bigbird"
        self.sparse_pattern = BigBirdPattern.from_config(config, layer_idx) if bigbird else None
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.o_proj.is_residual_output = True  # type: ignore[assignment]  # read by the weight init
        # µP: scores q.k / sqrt(head_dim * m), i.e. sqrt(base head_dim) / head_dim for heads that
        # widen with the model; applied to q, so that dense and block-sparse attention share it.
        self.query_multiplier = width_multiplier(config) ** -0.5
        # Dense attention of (batch, heads, seq, head_dim) q, k, v with SDPA's signature; code that
        # distributes the computation replaces it from outside.
        self.core: Callable[..., torch.Tensor] = F.scaled_dot_product_attention

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: "DynamicCache | PackedCache | None" = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel rewrite that shrinks the
        # projections to this rank's heads needs no change here.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.query_multiplier != 1.0:
            q = q * self.query_multiplier
        if cache is not None and isinstance(cache, PackedCache):
            y = cache.attend(q, k, v, self.layer_idx, self.attend)
        else:
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
            y = self.attend(q, k, v, attn_mask)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of (batch, heads, seq, head_dim) queries over the keys/values they see (the
        cache's included) under `attn_mask` (attention_mask_4d's, or None for plain causal)."""
        seq = q.shape[2]
        if attn_mask is not None and attn_mask.shape[-1] > k.shape[2]:
            attn_mask = attn_mask[..., -k.shape[2] :]  # a sliding-window cache keeps only the newest keys
        if self.sliding_window is not None and k.shape[2] > self.sliding_window:
            attn_mask = sliding_window_mask(attn_mask, seq, k.shape[2], self.sliding_window, q.device)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout = self.dropout if self.training else 0.0
        if self.sparse_pattern is not None:
            sparse = decoder_sparse_attention if self.causal else encoder_sparse_attention
            return sparse(q, k, v, self.sparse_pattern, attn_mask, dropout)
        return self.core(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=self.causal and attn_mask is None and seq > 1
        )


@runtime_checkable
class PackedCache(Protocol):
    """The cache of a forward whose one row packs the new tokens of several sequences, vLLM's
    flattened batch: embeddings, projections, norms and MLPs run once over all the tokens, and
    the cache runs each sequence's attention against that sequence's own keys/values."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    ) -> torch.Tensor:
        """q, k, v: (1, heads, tokens, head_dim), rotated -> the attention output, same shape and
        order; `attend(q, k, v, attn_mask)` is the layer's own attention over a group's keys."""
        ...

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: the packed row's masks are the cache's, not the model's."""
        ...


class SwiGLU(nn.Module):
    def __init__(self, config: LLMStackConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.down_proj.is_residual_output = True  # type: ignore[assignment]  # read by the weight init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    def __init__(self, config: LLMStackConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.down_proj.is_residual_output = True  # type: ignore[assignment]  # read by the weight init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


def build_mlp(config: LLMStackConfig, layer_idx: int) -> nn.Module:
    """The layer's MLP: an MoE block on the layers config.moe_layers names (when it has experts),
    else a dense SwiGLU or GELU MLP."""
    if layer_idx in moe_layer_indices(config):
        shared = config.moe_shared_intermediate_size
        return MoEBlock(config, SwiGLU(config, shared) if shared else None)
    return SwiGLU(config) if config.activation == "swiglu" else GeluMLP(config)


class DecoderLayer(nn.Module):
    def __init__(self, config: LLMStackConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_idx)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        router: RouterRecord | None = None,
    ) -> torch.Tensor:
        """`router`: an MoE layer's routing record of this forward pass (see llmstack.models.moe)."""
        if self.pre_norm:
            x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, cache))
            return x + self.dropout(self.feed_forward(self.post_attention_layernorm(x), router))
        x = self.input_layernorm(x + self.dropout(self.self_attn(x, cos, sin, attn_mask, cache)))
        return self.post_attention_layernorm(x + self.dropout(self.feed_forward(x, router)))

    def feed_forward(self, x: torch.Tensor, router: RouterRecord | None) -> torch.Tensor:
        return self.mlp(x, router) if isinstance(self.mlp, MoEBlock) else self.mlp(x)


class LLMStackPreTrainedModel(PreTrainedModel):
    config_class = LLMStackConfig
    config: LLMStackConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def head_and_loss(
        self, hidden: torch.Tensor, targets: torch.Tensor | None, num_items_in_batch: float | torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(loss, logits) of lm_head over `hidden`, targets aligned with it. Training needs the loss
        only: computed from the hidden states, it never holds the (tokens x vocabulary) logits, and
        logits are None then."""
        loss = None
        if targets is not None and self.training:
            loss = self.loss_from_hidden(hidden, targets, num_items_in_batch)
            if loss is not None:
                return loss, None
        logits = self.lm_head(hidden)
        if targets is not None:
            loss = self.loss_from_logits(logits, targets, num_items_in_batch)
        return loss, logits

    def loss_options(self) -> LossOptions:
        """The config's loss options, as causal_lm_loss takes them."""
        return loss_options(self.config)

    def loss_from_logits(
        self, logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch: float | torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(self.lm_head, HeadWithLoss):
            return self.lm_head.loss_from_logits(logits, targets, num_items_in_batch, self.loss_options())
        return causal_lm_loss(logits, targets, num_items_in_batch=num_items_in_batch, **self.loss_options())

    def loss_from_hidden(
        self, hidden: torch.Tensor, targets: torch.Tensor, num_items_in_batch: float | torch.Tensor | None
    ) -> torch.Tensor | None:
        """The loss of lm_head(hidden) computed a chunk of tokens at a time (linear_cross_entropy);
        None where lm_head is not a plain linear layer holding its whole weight here (an adapter
        wraps it): the caller then goes through the logits. Under ZeRO-3 reading the weight inside
        the engine's forward gathers it (DeepSpeed registers it as an external parameter). A head
        with a loss of its own (HeadWithLoss) computes it."""
        if isinstance(self.lm_head, HeadWithLoss):
            return self.lm_head.loss_from_hidden(hidden, targets, num_items_in_batch, self.loss_options())
        weight = self.lm_head.weight
        if type(self.lm_head) is not nn.Linear or not isinstance(weight, torch.Tensor):
            return None
        if weight.shape != (self.config.vocab_size, hidden.shape[-1]):
            return None
        return linear_cross_entropy(
            hidden, weight, targets, num_items_in_batch=num_items_in_batch, **self.loss_options()
        )

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        cfg = self.config
        std = cfg.initializer_range
        m = width_multiplier(cfg)  # µP (llmstack.models.mup): hidden weights' variance 1/m, the router's 1/m^2
        hidden_std = std / math.sqrt(m)
        if isinstance(module, nn.Linear):
            if cfg.init_method == "xavier":
                init.xavier_uniform_(module.weight)
            elif module is getattr(self, "lm_head", None):  # the readout, under the output multiplier
                init.normal_(module.weight, mean=0.0, std=std)
            elif getattr(module, "is_residual_output", False):
                init.normal_(module.weight, mean=0.0, std=hidden_std / math.sqrt(2 * cfg.num_hidden_layers))
            else:
                init.normal_(module.weight, mean=0.0, std=hidden_std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, TopKRouter):
            init.normal_(module.weight, mean=0.0, std=std / m)
        elif isinstance(module, Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=hidden_std)
            init.normal_(module.down_proj, mean=0.0, std=hidden_std / math.sqrt(2 * cfg.num_hidden_layers))
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, rope_frequencies(cfg)[0])


class LLMStackModel(LLMStackPreTrainedModel):
    """The Transformer body: token embeddings, decoder layers, final norm (pre-LN only)."""

    def __init__(self, config: LLMStackConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = final_norm(config)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        router: RouterRecord | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states; `router` collects the MoE layers' routing (see llmstack.models.moe).
        `document_ids` (batch, seq): each token's document within a packed sequence; attention then
        stays inside a document (pass each document's own `position_ids` with them)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
        attn_mask = attention_mask_4d(attention_mask, x.shape[1], past, x.device, causal=self.config.causal)
        if document_ids is not None:
            if past:
                raise ValueError("document_ids mask a packed sequence computed whole, not a KV-cache step")
            if self.config.attention_pattern == "bigbird":
                raise ValueError("document_ids are not supported with attention_pattern bigbird")
            attn_mask = document_mask(document_ids, attn_mask, causal=self.config.causal)
        cos, sin = self.rotary_emb(x, position_ids)
        x = self.dropout(x)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpointed_call(self, layer.__call__, x, cos, sin, attn_mask, cache, router)
            else:
                x = layer(x, cos, sin, attn_mask, cache, router)
        return self.norm(x)


def final_norm(config: LLMStackConfig) -> nn.Module:
    """The body's last module: RMSNorm after pre-LN blocks (post-LN blocks end in a norm already; a
    second one would only rescale), with µP's output multiplier 1/m. It sits here, before the head,
    so that every path to the logits (the head, the chunked loss, tensor-parallel and pipeline
    heads) gets it and a tied embedding stays an input weight."""
    multiplier = 1.0 / width_multiplier(config)
    if config.norm_position == "pre":
        return RMSNorm(config.hidden_size, config.rms_norm_eps, multiplier)
    return nn.Identity() if multiplier == 1.0 else Multiplier(multiplier)


def attention_mask_4d(
    attention_mask: torch.Tensor | None, q_len: int, past: int, device: torch.device, causal: bool = True
) -> torch.Tensor | None:
    """Boolean (batch, 1, q, k) mask for SDPA, or None when plain causal (or, for an encoder,
    plain bidirectional) attention will do.

    A query attends to keys that are not padding, and, when `causal`, only to those at or before
    its own position. Each query also attends to itself, so that a padding query's row is never
    empty (an empty row makes NaNs); what padding positions compute is never used.
    """
    if attention_mask is None or bool(attention_mask.all()):
        if past == 0 or q_len == 1 or not causal:  # one new token sees every key; so does an encoder's
            return None
        attention_mask = None
    k_len = past + q_len
    q_pos = torch.arange(past, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = (k_pos <= q_pos if causal else k_pos >= 0)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -k_len:].bool()
        mask = mask | (k_pos == q_pos)[None, None]
    return mask


def document_mask(
    document_ids: torch.Tensor, attn_mask: torch.Tensor | None = None, causal: bool = True
) -> torch.Tensor:
    """Boolean (batch, 1, seq, seq) mask for SDPA: a query reads the keys of its own document
    (`document_ids`, (batch, seq)), when `causal` only those at or before it, and within
    `attn_mask` (attention_mask_4d's, padding) where one is given. Every query reads its own key."""
    mask = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
    if causal:
        seq = document_ids.shape[-1]
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return mask if attn_mask is None else mask & attn_mask


def sliding_window_mask(
    attn_mask: torch.Tensor | None, q_len: int, k_len: int, window: int, device: torch.device
) -> torch.Tensor:
    """`attn_mask` (or plain causal attention when None) further limited to the `window` newest keys
    up to each query's position, as Mistral's sliding-window attention."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    in_window = (k_pos > q_pos - window)[None, None]
    if attn_mask is None:
        return in_window & (k_pos <= q_pos)[None, None]
    # A padding query keeps its own key (see attention_mask_4d), which lies in its window.
    return attn_mask & in_window


class LLMStackForCausalLM(LLMStackPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LLMStackConfig) -> None:
        super().__init__(config)
        self.model = LLMStackModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: float | torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """`labels` follow Hugging Face (aligned with input_ids, shifted here); `shift_labels` are
        already shifted, as the trainer's packed blocks provide them. The loss is the summed token
        loss divided by `num_items_in_batch`, by default the number of scored targets (see
        llmstack.models.loss). `document_ids` with `position_ids`: a packed sequence's documents,
        each attending within itself (see LLMStackModel.forward). `logits_to_keep`: the last n
        positions, or a tensor of the positions to keep (transformers' convention). `cache` may be a
        PackedCache: several sequences' new tokens in one row."""
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        router = None
        if self.config.num_local_experts:  # the auxiliary losses skip padding and ignored positions
            seq_len = (input_ids if input_ids is not None else inputs_embeds).shape[1]  # type: ignore[union-attr]
            router = RouterRecord(router_token_mask(seq_len, attention_mask, labels))
        hidden = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, router, document_ids)
        if isinstance(logits_to_keep, torch.Tensor):  # positions to keep, as in transformers
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        cache = cache if use_cache else None
        targets = next_token_targets(labels, shift_labels)
        loss, logits = self.head_and_loss(hidden, targets, num_items_in_batch)
        stats = list(router.stats) if router is not None else []  # not the recomputed passes of checkpointing
        if not stats:
            return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        aux_loss = torch.stack([s.aux_loss for s in stats]).mean()
        router_z_loss = torch.stack([s.z_loss for s in stats]).mean()
        if loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss + self.config.router_z_loss_coef * router_z_loss
        return MoECausalLMOutputWithPast(
            loss=loss, logits=logits, cache=cache, aux_loss=aux_loss, router_z_loss=router_z_loss, router_stats=stats
        )


__all__ = ["LLMStackForCausalLM", "LLMStackModel", "LLMStackPreTrainedModel", "causal_lm_loss", "IGNORE_INDEX"]
