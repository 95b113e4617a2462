"""The hand-written training backwards of modeling_llmstack (RMSNorm, rotary positions) against
autograd through the plain formulas they replace: same values and gradients."""

import torch

from llmstack import LLMStackConfig
from llmstack.models.modeling_llmstack import RMSNorm, RotaryEmbedding, apply_rotary, rotate_half


def _values_and_grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    inputs = tuple(t.detach().clone().requires_grad_() for t in inputs)
    out = fn(*inputs)
    out.backward(torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape))
    return [out.detach(), *(t.grad for t in inputs)]


def _assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_rmsnorm_training_backward_equals_autograd_of_the_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, 16) * 3

    def formula(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    def module(x, weight):
        out = torch.func.functional_call(norm, {"weight": weight}, (x,))
        assert "RMSNorm" in type(out.grad_fn).__name__  # the hand-written backward runs
        return out

    _assert_all_close(_values_and_grads(module, x, norm.weight), _values_and_grads(formula, x, norm.weight))


def test_rotary_training_backward_equals_autograd_of_the_formula():
    torch.manual_seed(0)
    config = LLMStackConfig(hidden_size=32, num_attention_heads=2, vocab_size=11, num_hidden_layers=1)
    x = torch.randn(2, 2, 7, 16)
    cos, sin = RotaryEmbedding(config)(x, torch.arange(7)[None])

    def formula(x):
        return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)

    out = _values_and_grads(lambda x: apply_rotary(x, cos, sin), x)
    assert "Rotary" in type(apply_rotary(x.requires_grad_(), cos, sin).grad_fn).__name__
    _assert_all_close(out, _values_and_grads(formula, x.detach()))
