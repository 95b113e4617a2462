"""ONNX export of the decoder with KV-cache inputs and outputs, and greedy decoding through
onnxruntime.

The graph takes `input_ids`, `attention_mask` (over past and new tokens), `position_ids` and
`past_key_<i>`/`past_value_<i>` for each layer (batch, kv_heads, past, head_dim), and returns
`logits` and `present_key_<i>`/`present_value_<i>` (past + new). Batch, sequence and past lengths
are dynamic axes; the first step passes empty past tensors. It is traced with a left-padded input
and a non-empty past, so the graph always builds the explicit attention mask and serves padded
batches, prefill and decode alike.

Needs `onnx` and `onnxruntime` (the [onnx] extra), imported where used.
"""

import os
import warnings

import numpy as np
import torch
from torch import nn
from transformers import LlamaForCausalLM, PreTrainedModel

from llmstack.models import from_llama


class TensorCache:
    """Past keys/values given as tensors, extended by each layer's `update`: the part of
    transformers' `Cache` llmstack's attention calls, written so tracing records it."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = list(past)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0][0].shape[2]

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        past_keys, past_values = self.layers[layer_idx]
        self.layers[layer_idx] = (torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2))
        return self.layers[layer_idx]


class DecoderWithCache(nn.Module):
    """Flat tensors in and out, as ONNX graphs take them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        cache = TensorCache(list(zip(past[0::2], past[1::2])))
        logits = self.model(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        ).logits
        return (logits, *(t for layer in cache.layers for t in layer))


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_onnx(model: PreTrainedModel, path: str, opset: int = 17) -> None:
    """Write `model` (llmstack or Llama format, fp32) as an ONNX decoder with a KV cache to `path`."""
    model = (from_llama(model) if isinstance(model, LlamaForCausalLM) else model).float().eval()
    config = model.config
    inputs, outputs = io_names(config.num_hidden_layers)
    batch, past_len, new_len = 2, 3, 4
    input_ids = torch.randint(0, config.vocab_size, (batch, new_len))
    attention_mask = torch.ones(batch, past_len + new_len, dtype=torch.long)
    attention_mask[1, 0] = 0  # a left-padded row: the traced graph keeps the general mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past_len:]
    past = [
        torch.randn(batch, config.num_key_value_heads, past_len, config.head_dim)
        for _ in range(2 * config.num_hidden_layers)
    ]
    dynamic_axes = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    dynamic_axes |= {name: {0: "batch", 2: "past_sequence"} for name in inputs[3:]}
    dynamic_axes |= {name: {0: "batch", 2: "total_sequence"} for name in outputs[1:]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # The tracer warns about the mask's Python branches; tracing a padded batch with a past took
    # the branch that is right for every input.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            DecoderWithCache(model),
            (input_ids, attention_mask, position_ids, *past),
            path,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=dynamic_axes,
            opset_version=opset,
            dynamo=False,
        )


def quantize_int8(path: str, out_path: str) -> None:
    """Dynamic int8 quantization of the weights of matrix multiplications (activations are
    quantized on the fly), by onnxruntime."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(path, out_path, weight_type=QuantType.QInt8)


class OnnxDecoder:
    """An exported decoder run by onnxruntime on the CPU."""

    def __init__(self, path: str, threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_")]
        self.past_names = [i.name for i in past]
        self.kv_heads, self.head_dim = past[0].shape[1], past[0].shape[3]

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: list[np.ndarray] | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits, present keys/values); `past` None starts from an empty cache."""
        if past is None:
            empty = np.zeros((input_ids.shape[0], self.kv_heads, 0, self.head_dim), dtype=np.float32)
            past = [empty] * len(self.past_names)
        feed = {
            "input_ids": input_ids.astype(np.int64),
            "attention_mask": attention_mask.astype(np.int64),
            "position_ids": position_ids.astype(np.int64),
            **dict(zip(self.past_names, past)),
        }
        logits, *present = self.session.run(None, feed)
        return logits, present

    def greedy(self, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
        """Greedy continuation of one prompt with the KV cache, as `generate` decodes it."""
        ids = np.array([prompt], dtype=np.int64)
        logits, past = self.forward(ids, np.ones_like(ids), np.arange(len(prompt))[None])
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            if token == eos_token_id:
                break
            tokens.append(token)
            total = len(prompt) + len(tokens)
            logits, past = self.forward(np.array([[token]]), np.ones((1, total)), np.array([[total - 1]]), past)
        return tokens
