"""The llmstack model as a DeepSpeed `PipelineModule`, trained by DeepSpeed's pipeline engine (1F1B).

Pipeline layers, in order:

    0          token embedding (and embedding dropout)   TiedLayerSpec("embed") if embeddings are tied
    1 .. L     decoder layers                            checkpointed every N layers if asked
    L + 1      final norm                                a FinalNormPipe around it for an MoE model
    L + 2      output layer                              the tied embedding's `head`, or lm_head

Stages pass one tensor, the hidden states, so attention is plainly causal over each block (packed
pretraining data: no padding mask, no KV cache). A mixture-of-experts model's stages also carry
its MoE layers' auxiliary losses summed so far, in one more position of that tensor (see
`pack_router_losses`), which the loss adds with their coefficients as the plain model's forward
does. The engine feeds (input_ids, labels) pairs, labels being the targets or (targets,
num_items_in_batch), and applies the model's loss (`LLMStackPipeline.loss`).
In training the output layer passes the final hidden states through and the loss reads its weight,
a chunk of tokens at a time, as the plain model's does (no tokens x vocabulary logits); in eval
mode it computes the logits and the loss is the plain negative log-likelihood. When the topology is
also tensor-parallel the model is `parallelize`d first and both losses work on vocabulary shards.
DeepSpeed's pipeline engine sends activation shapes once, so every micro-batch must have the same
shape: variable-length (fine-tuning) batches do not fit.

Every rank builds (or receives) the whole model on the CPU; the PipelineModule keeps and moves to
the accelerator only its own stage's layers.
"""

from collections.abc import Callable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

from llmstack.compat.deepspeed import pipeline_stage, split_pipeline_state_key, wrap_last_pipeline_layer
from llmstack.models.configuration_llmstack import LLMStackConfig
from llmstack.models.loss import causal_lm_loss, linear_cross_entropy, loss_options
from llmstack.models.modeling_encoder import LLMStackForMaskedLM, model_for
from llmstack.models.modeling_llmstack import DecoderLayer, LLMStackForCausalLM, RotaryEmbedding
from llmstack.models.moe import RouterRecord, RouterStats, moe_layer_indices

from .cross_entropy import vocab_parallel_cross_entropy
from .tensor_parallel import VocabParallelHead, parallelize
from .topology import Topology

TIED_EMBEDDING_KEY = "embed"


def pack_router_losses(hidden: torch.Tensor, aux_loss: torch.Tensor, z_loss: torch.Tensor) -> torch.Tensor:
    """hidden (batch, seq, hidden) with one more position whose first two features hold the
    load-balancing and router z-loss sums. One tensor, not a tuple: the pipeline engine runs one
    backward per output tensor, and DeepSpeed's activation checkpointing allows only one (torch's
    non-reentrant checkpoint would recompute the stage once per output). The sums are rounded to
    the hidden states' dtype (bf16: 3 significant digits of the logged loss's router terms); their
    gradient is exact."""
    losses = torch.stack([aux_loss, z_loss]).to(hidden.dtype)
    extra = F.pad(losses, (0, hidden.shape[-1] - 2)).expand(hidden.shape[0], 1, -1)
    return torch.cat([hidden, extra], dim=1)


def unpack_router_losses(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, load-balancing loss sum, router z-loss sum) of `pack_router_losses`' tensor."""
    aux_loss, z_loss = x[0, -1, :2].float().unbind()
    return x[:, :-1], aux_loss, z_loss


class EmbeddingPipe(nn.Module):
    """Token embedding; when embeddings are tied it also holds lm_head (sharing the weight) and
    serves as the output layer through `head`. With `router_losses` it starts the auxiliary loss
    sums of a mixture-of-experts model at zero."""

    def __init__(
        self,
        embed_tokens: nn.Module,
        dropout: nn.Module,
        lm_head: nn.Module | None = None,
        router_losses: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens, self.dropout, self.lm_head = embed_tokens, dropout, lm_head
        self.router_losses = router_losses

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.dropout(self.embed_tokens(input_ids))
        if not self.router_losses:
            return hidden
        zero = hidden.new_zeros((), dtype=torch.float32)
        return pack_router_losses(hidden, zero, zero)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None  # only the tied embedding serves as the head
        return self.lm_head(hidden)


class DecoderLayerPipe(nn.Module):
    """A decoder layer that computes its rotary tables from the block length (positions 0..seq-1).
    With `router_losses` it adds its MoE block's auxiliary losses (if it has one) to the sums."""

    def __init__(self, layer: DecoderLayer, rotary_emb: RotaryEmbedding, router_losses: bool = False) -> None:
        super().__init__()
        self.layer, self.rotary_emb, self.router_losses = layer, rotary_emb, router_losses
        self.router_stats: RouterStats | None = None  # its MoE block's, in the last micro-batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.router_losses:
            return self._layer(x)
        hidden, aux_loss, z_loss = unpack_router_losses(x)
        router = RouterRecord()
        hidden = self._layer(hidden, router)
        if router.stats:  # the layer's MoE block, in this micro-batch
            self.router_stats = router.stats[0]
            aux_loss, z_loss = aux_loss + self.router_stats.aux_loss, z_loss + self.router_stats.z_loss
        return pack_router_losses(hidden, aux_loss, z_loss)

    def _layer(self, hidden: torch.Tensor, router: RouterRecord | None = None) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, positions)
        return self.layer(hidden, cos, sin, router=router)


class FinalNormPipe(nn.Module):
    """A mixture-of-experts model's final norm: normalizes the hidden states and carries the router
    loss sums on. (A dense model's stage runs the norm module itself.)"""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, aux_loss, z_loss = unpack_router_losses(x)
        return pack_router_losses(self.norm(hidden), aux_loss, z_loss)


def to_pipeline(
    model_or_config: LLMStackForCausalLM | LLMStackForMaskedLM | LLMStackConfig,
    topology: Topology,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
) -> "LLMStackPipeline":
    """An `LLMStackPipeline` over `topology` from an LLMStackForCausalLM (consumed: its modules become
    the pipeline's) or from a config (a fresh model, initialized as the model class does).

    partition_method: "parameters" (balance parameter counts), "uniform" (balance layer counts),
        or any other DeepSpeed method, e.g. "type:DecoderLayerPipe" (balance decoder layers only).
    activation_checkpoint_interval: recompute activations in the backward pass, in chunks of this
        many decoder layers; 0 keeps them all.
    """
    model = model_or_config
    if isinstance(model, LLMStackConfig):  # a decoder's or encoder's (the layout table refuses embeddings)
        model = cast(LLMStackForCausalLM | LLMStackForMaskedLM, model_for(model))
    if topology.tensor_parallel_size > 1 and not isinstance(model.lm_head, VocabParallelHead):
        parallelize(model, topology)
    if isinstance(model.lm_head, VocabParallelHead) and model.lm_head.sequence_parallel:
        raise ValueError("pipeline stages pass whole sequences: parallelize the model without sequence_parallel")
    return LLMStackPipeline(model, topology, partition_method, activation_checkpoint_interval)


class LLMStackPipeline(PipelineModule):
    """PipelineModule of an llmstack model's layers, which knows their names in the plain model."""

    def __init__(
        self,
        model: LLMStackForCausalLM | LLMStackForMaskedLM,
        topology: Topology,
        partition_method: str,
        activation_checkpoint_interval: int,
    ) -> None:
        self.config = model.config
        self.token_loss = _token_loss(self.config, topology)
        self.moe_layers = moe_layer_indices(self.config)
        router_losses = bool(self.moe_layers)
        body = model.model
        decoder_layers = [DecoderLayerPipe(layer, body.rotary_emb, router_losses) for layer in body.layers]
        if self.config.tie_word_embeddings:
            modules = (body.embed_tokens, body.dropout, model.lm_head, router_losses)
            tied = {"tied_weight_attr": "embed_tokens.weight"}
            embed = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, *modules, **tied)
            head = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, *modules, forward_fn=EmbeddingPipe.head, **tied)
        else:
            embed, head = EmbeddingPipe(body.embed_tokens, body.dropout, router_losses=router_losses), model.lm_head
        norm = FinalNormPipe(body.norm) if router_losses else body.norm
        super().__init__(
            layers=[embed, *decoder_layers, norm, head],
            topology=topology.layout,
            loss_fn=self.loss,
            partition_method=partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            checkpointable_layers=[DecoderLayerPipe.__name__],
        )
        stage, stages = pipeline_stage(self)
        if stage == stages - 1:
            wrap_last_pipeline_layer(self, lambda head: HiddenInTraining(self, head))

    def output_layer(self) -> nn.Module:
        """The last stage's lm_head: the tied embedding's, or its own layer."""
        if self.config.tie_word_embeddings:
            return self.tied_modules[TIED_EMBEDDING_KEY].lm_head
        return self.get_submodule(str(self.config.num_hidden_layers + 2))

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The engine's loss_fn. outputs: the final hidden states (with a mixture-of-experts model's
        router loss sums) in training, the logits in eval mode (see HiddenInTraining). labels: the
        targets (the loss is their mean) or (targets, num_items_in_batch) (see llmstack.models.loss).
        In training mode this is the model's objective, from the hidden states a chunk of tokens at a
        time, plus the router losses' means over the MoE layers times their coefficients; in eval
        mode the plain negative log-likelihood, without label smoothing, z-loss, focal weighting or
        router losses, which is what evaluation reports."""
        targets, num_items_in_batch = labels if isinstance(labels, (tuple, list)) else (labels, None)
        if not self.training:
            return self.token_loss(outputs, targets, num_items_in_batch=num_items_in_batch)
        hidden = outputs
        if self.moe_layers:
            hidden, aux_loss, z_loss = unpack_router_losses(outputs)
        head = self.output_layer()
        options = loss_options(self.config)
        if isinstance(head, VocabParallelHead):
            loss = head.loss_from_hidden(hidden, targets, num_items_in_batch, options)
            assert loss is not None  # pipelines run ZeRO 0-1: the head holds its whole shard
        else:
            weight = cast(torch.Tensor, head.weight)
            loss = linear_cross_entropy(hidden, weight, targets, num_items_in_batch=num_items_in_batch, **options)
        if self.moe_layers:
            router = self.config.router_aux_loss_coef * aux_loss + self.config.router_z_loss_coef * z_loss
            loss = loss + router / len(self.moe_layers)
        return loss

    def router_stats(self) -> tuple[list[int], list[RouterStats]]:
        """This stage's MoE layers (the model's layer indices) and their router statistics of the
        last forward pass."""
        layers, stats = [], []
        for name, module in self.named_children():
            if isinstance(module, DecoderLayerPipe) and module.router_stats is not None:
                layers.append(int(name) - 1)
                stats.append(module.router_stats)
        return layers, stats

    def plain_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This stage's part of the state dict (or `state`, keyed as this stage's), under the plain model's names."""
        layers = self.config.num_hidden_layers
        state = self.state_dict() if state is None else state
        return {plain_pipeline_name(name, layers): tensor for name, tensor in state.items()}


class HiddenInTraining:
    """The last stage's output layer as the pipeline runs it: in training it hands the final hidden
    states to the loss unchanged (the loss applies lm_head's weight itself); in eval mode it is the
    layer. Everything else (state_dict, load_state_dict, ...) is the layer's, so checkpoints name
    and hold the same tensors."""

    def __init__(self, pipeline: nn.Module, layer: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.pipeline, self.layer = pipeline, layer

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pipeline.training:
            return hidden
        return self.layer(unpack_router_losses(hidden)[0] if self.pipeline.moe_layers else hidden)

    def __getattr__(self, name: str) -> object:
        if name in ("pipeline", "layer"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)


def _token_loss(config: LLMStackConfig, topology: Topology) -> Callable[..., torch.Tensor]:
    """causal_lm_loss, from vocabulary-split logits when the topology is tensor-parallel."""
    if topology.tensor_parallel_size > 1:
        return partial(vocab_parallel_cross_entropy, group=topology.tensor_parallel_group, vocab_size=config.vocab_size)
    return causal_lm_loss


def plain_pipeline_name(name: str, num_hidden_layers: int) -> str:
    """The plain model's name of a PipelineModule parameter or state-dict key `name`."""
    layer, key = split_pipeline_state_key(name)
    layer_index = 0 if isinstance(layer, str) else layer  # the tied embedding (the only tie) is layer 0's
    return plain_name(layer_index, key, num_hidden_layers)


def plain_name(layer_index: int, key: str, num_hidden_layers: int) -> str:
    """Name in the plain model's state dict of parameter `key` of pipeline layer `layer_index`."""
    if layer_index == 0:
        return key if key.startswith("lm_head.") else f"model.{key}"
    if layer_index <= num_hidden_layers:
        return f"model.layers.{layer_index - 1}.{key.removeprefix('layer.')}"
    if layer_index == num_hidden_layers + 1:
        return f"model.norm.{key.removeprefix('norm.')}"  # a FinalNormPipe holds the norm as .norm
    return f"lm_head.{key}"
