"""The MoE auxiliary losses skip padding (attention_mask 0) and ignored positions (label -100), as
transformers' `load_balancing_loss_func` does given an attention mask."""

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from llmstack.models import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.moe import TopKRouter

TOLERANCE = 1e-5  # fp32; measured differences <= 2.4e-7 against transformers and by hand (seeds 0-4)


def model_and_router_logits(seed):
    torch.manual_seed(seed)
    config = LLMStackConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_layers=[1],  # one MoE layer: transformers pools over layers, llmstack averages per layer
        router_z_loss_coef=0.001,
    )
    model = LLMStackForCausalLM(config).eval()
    logits = []
    next(m for m in model.modules() if isinstance(m, TopKRouter)).register_forward_hook(
        lambda module, args, out: logits.append(out)
    )
    return model, logits


@pytest.mark.parametrize("seed", range(5))
def test_aux_and_z_losses_count_only_unpadded_scored_positions(seed):
    model, router_logits = model_and_router_logits(seed)
    ids = torch.randint(0, 64, (3, 10))
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[0, 7:] = 0  # right padding
    attention_mask[2, :4] = 0  # left padding
    labels = ids.clone()
    labels[1, :3] = -100  # a prompt that is not scored
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask, labels=labels)
    logits = router_logits[-1]
    counted = (attention_mask.bool() & (labels != -100)).reshape(-1)
    expected_aux = load_balancing_loss_func((logits,), 4, 2, attention_mask=counted.view(3, 10).long())
    assert float(out.aux_loss) == pytest.approx(float(expected_aux), abs=TOLERANCE)
    expected_z = torch.logsumexp(logits[counted], dim=-1).pow(2).mean()
    assert float(out.router_z_loss) == pytest.approx(float(expected_z), abs=TOLERANCE)
    # What a padded position holds changes nothing that is counted.
    other = ids.masked_fill(~attention_mask.bool(), 5)
    with torch.no_grad():
        again = model(other, attention_mask=attention_mask, labels=labels)
    assert float(again.aux_loss) == pytest.approx(float(out.aux_loss), abs=TOLERANCE)
    # Without masks every position counts.
    with torch.no_grad():
        unmasked = model(ids)
    assert float(unmasked.aux_loss) == pytest.approx(float(load_balancing_loss_func((router_logits[-1],), 4, 2)))
