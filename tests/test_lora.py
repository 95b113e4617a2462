import pytest
import torch
from inference_fixtures import tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llmstack import LLMStackForCausalLM
from llmstack.errors import UserError
from llmstack.training.finetune.lora import add_lora, add_prompt_tuning, merge_lora

STEPS = 15


def task():
    """Four fixed sequences to memorize."""
    return torch.randint(2, 320, (4, 12), generator=torch.Generator().manual_seed(0))


def train(model, steps=STEPS):
    """Plain AdamW over every parameter that requires grad; returns the first and last loss."""
    model.train()
    data = task()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses[0], losses[-1]


@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = tiny_model()
    base.save_pretrained(root / "base")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = add_lora(base, rank=4, alpha=8, dropout=0.0)
    losses = train(model)
    model.save_pretrained(root / "adapter")
    return root, model, before, losses


def test_lora_trains_only_the_adapters_and_the_loss_falls(trained_lora):
    _, model, before, (first, last) = trained_lora
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(targets)  # e.g. ...q_proj.lora_A.default.weight
    base = model.get_base_model().state_dict()
    for name, weight in before.items():
        key = next(k for k in base if k.replace(".base_layer", "") == name)
        assert torch.equal(base[key], weight), name
    assert last < 0.5 * first


def test_adapter_is_saved_without_the_base_weights(trained_lora):
    root, model, _, _ = trained_lora
    saved = load_file(root / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_merged_model_logits_equal_base_plus_adapter(trained_lora):
    root, model, _, _ = trained_lora
    merge_lora(root / "base", root / "adapter", root / "merged")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged")
    assert type(merged) is LLMStackForCausalLM
    assert not any("lora" in n for n, _ in merged.named_parameters())
    data = torch.randint(0, 320, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=data).logits
        base = AutoModelForCausalLM.from_pretrained(root / "base")(input_ids=data).logits
        torch.testing.assert_close(merged(input_ids=data).logits, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base, expected, atol=1e-2)  # the adapter did change the model


def test_prompt_tuning_learns_only_the_soft_prompt_and_cannot_be_merged(tmp_path, trained_lora):
    root = trained_lora[0]
    base = tiny_model()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = add_prompt_tuning(base, num_virtual_tokens=4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["prompt_encoder.default.embedding.weight"]
    first, last = train(model, steps=10)
    assert last < first
    assert all(torch.equal(base.state_dict()[k], v) for k, v in before.items())
    model.save_pretrained(tmp_path / "prompt")
    with pytest.raises(UserError, match="only LoRA adapters can be merged"):
        merge_lora(root / "base", tmp_path / "prompt", tmp_path / "merged")
    with pytest.raises(UserError, match="not found"):
        merge_lora(root / "base", tmp_path / "missing", tmp_path / "merged")
