"""Tiled MLPs (as DeepSpeed ALST's TiledMLP): each decoder layer's MLP runs over its input a tile
of tokens at a time, so that its (tokens x intermediate) activations never exist whole.

    tile_mlps(model, tile_tokens=2048)   # train.tiled_mlp_tokens; applied with the layout

The forward pass computes each tile's output with no autograd graph and keeps only the MLP's
input; the backward pass recomputes one tile at a time and takes its gradients there, summing the
weight gradients over the tiles. The MLP's autograd memory falls from a few (tokens x
intermediate) tensors to its (tokens x hidden) input, for one more MLP forward per step.

Applied from outside: each dense MLP keeps its class, parameters and names, and gets a forward
that tiles (input of at most `tile_tokens` tokens: the plain forward). It composes with activation
checkpointing (the tiles are recomputed inside the layer's recomputation) and with context
parallelism (a rank tiles its own tokens). An MoE block is left whole: its router and expert
capacity count the layer's tokens together (the layout table refuses the combination).

llmstack's SwiGLU over plain linear layers takes its tiles' gradients by a hand-written backward
(the weight gradients added in place, a few tile activations alive at once: about half the
transient memory of autograd's per-tile graph, which sets a context-parallel rank's peak); any
other MLP goes through autograd a tile at a time.

The weight gradients are returned to autograd once per MLP, summed over the tiles, so whatever
hooks a parameter's gradient (DeepSpeed's ZeRO 1-2 reduction) fires once; ZeRO-3, whose
parameters are partitioned outside their own module's forward, is refused by the layout table.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmstack.models.modeling_llmstack import DecoderLayer, SwiGLU
from llmstack.models.moe import MoEBlock


def tile_mlps(model: nn.Module, tile_tokens: int) -> int:
    """Make every dense decoder-layer MLP of `model` run in tiles of `tile_tokens` tokens, in place;
    returns how many MLPs it tiled."""
    if tile_tokens < 1:
        raise ValueError(f"an MLP tile holds at least one token; got {tile_tokens}")
    tiled = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and not isinstance(layer.mlp, MoEBlock):
            layer.mlp.tile_tokens = tile_tokens  # type: ignore[assignment]
            layer.mlp.forward = types.MethodType(_tiled_forward, layer.mlp)  # type: ignore[method-assign]
            tiled += 1
    return tiled


def _tiled_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mlp`'s forward, a tile of tokens at a time where x holds more than one tile."""
    tile_tokens = int(mlp.tile_tokens)  # type: ignore[arg-type]  # set by tile_mlps
    if x.shape[:-1].numel() <= tile_tokens:
        return _plain_forward(mlp, x)
    return _TiledMLP.apply(mlp, tile_tokens, x, *mlp.parameters())


def _plain_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(mlp).forward(mlp, x)


class _TiledMLP(torch.autograd.Function):
    """mlp(x) over (..., hidden) x, tiles of `tile_tokens` tokens; `params` are the MLP's, passed
    so that their summed gradients come back through autograd."""

    @staticmethod
    def forward(ctx: Any, mlp: nn.Module, tile_tokens: int, x: torch.Tensor, *params: nn.Parameter) -> torch.Tensor:
        ctx.mlp, ctx.tile_tokens = mlp, tile_tokens
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(flat)
        for start in range(0, flat.shape[0], tile_tokens):  # a Function's forward builds no graph
            out[start : start + tile_tokens] = _plain_forward(mlp, flat[start : start + tile_tokens])
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        mlp, tile_tokens = ctx.mlp, ctx.tile_tokens
        needs_x = ctx.needs_input_grad[2]
        params = list(mlp.parameters())
        wanted = [p for p, needed in zip(params, ctx.needs_input_grad[3:], strict=True) if needed]
        flat_x, flat_grad = x.detach().reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        grad_x = torch.empty_like(flat_x) if needs_x else None
        if _is_plain_swiglu(mlp) and len(wanted) == len(params):
            sums = [torch.zeros_like(p) for p in params]
            for start in range(0, flat_x.shape[0], tile_tokens):
                tile = slice(start, start + tile_tokens)
                _swiglu_tile_backward(
                    mlp, flat_x[tile], flat_grad[tile], sums, None if grad_x is None else grad_x[tile]
                )
            return None, None, None if grad_x is None else grad_x.view(x.shape), *sums
        grad_params: list[torch.Tensor | None] = [None] * len(wanted)
        for start in range(0, flat_x.shape[0], tile_tokens):
            tile = flat_x[start : start + tile_tokens].detach().requires_grad_(needs_x)
            with torch.enable_grad():
                out = _plain_forward(mlp, tile)
            inputs = [tile] if needs_x else []
            grads = torch.autograd.grad(out, inputs + wanted, flat_grad[start : start + tile_tokens])
            if grad_x is not None:
                grad_x[start : start + tile_tokens] = grads[0]
            tile_grads = grads[len(inputs) :]
            # Dropped here, or this tile's graph and weight gradients would live through the next tile's.
            del out, grads
            grad_params = [g if summed is None else summed.add_(g) for summed, g in zip(grad_params, tile_grads)]
            del tile_grads
        by_param = iter(grad_params)
        param_grads = [next(by_param) if needed else None for needed in ctx.needs_input_grad[3:]]
        return None, None, None if grad_x is None else grad_x.view(x.shape), *param_grads


def _is_plain_swiglu(mlp: nn.Module) -> bool:
    """Whether `mlp` is llmstack's SwiGLU over plain linear layers (not tensor-parallel or adapted
    ones), whose backward `_swiglu_tile_backward` writes out."""
    if type(mlp) is not SwiGLU:
        return False
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    plain = all(type(layer) is nn.Linear and layer.bias is None for layer in layers)
    return plain and list(mlp.parameters()) == [layer.weight for layer in layers]  # in `sums`' order


def _swiglu_tile_backward(
    mlp: SwiGLU, x: torch.Tensor, grad_out: torch.Tensor, sums: list[torch.Tensor], grad_x: torch.Tensor | None
) -> None:
    """SwiGLU's backward over one tile, down(silu(gate(x)) * up(x)), by hand: the weight gradients
    are added into `sums` (gate, up, down) in place and the input gradient is written to `grad_x`.

    Autograd would give each tile its own weight-sized gradients and keep all four (tile x
    intermediate) activations through the backward; here a few of them live at once, so the
    tiles' transient memory is about half and no weight-sized temporaries exist.
    """
    sum_gate, sum_up, sum_down = sums
    w_gate, w_up, w_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    gate, up = F.linear(x, w_gate), F.linear(x, w_up)
    act = F.silu(gate)
    sum_down.addmm_(grad_out.t(), act * up)
    grad_hidden = grad_out @ w_down
    grad_up = grad_hidden * act
    del act
    grad_gate = torch.ops.aten.silu_backward(grad_hidden.mul_(up), gate)
    del gate, up, grad_hidden
    sum_up.addmm_(grad_up.t(), x)
    sum_gate.addmm_(grad_gate.t(), x)
    if grad_x is not None:
        torch.mm(grad_gate, w_gate, out=grad_x)
        grad_x.addmm_(grad_up, w_up)
