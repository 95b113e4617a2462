"""What `llmstack finetune` saves can be loaded by stock tools, offline: a LoRA adapter names its
base model's directory, and a full fine-tune of a Llama base is a Llama model again."""

import json

import torch
from inference_fixtures import tiny_model

from llmstack import from_llama, to_llama
from llmstack.training.finetune.lora import add_lora
from llmstack.training.finetune.run import save_in_base_format
from llmstack.training.loading import load_model


def test_a_lora_adapter_names_its_base_so_auto_peft_loads_it(tmp_path):
    from peft import AutoPeftModelForCausalLM

    to_llama(tiny_model()).save_pretrained(tmp_path / "base")
    adapted = add_lora(from_llama(load_model(str(tmp_path / "base"))), rank=4, dropout=0.0)  # as finetune does
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    save_in_base_format(adapted, str(tmp_path / "adapter"), str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    ids = torch.arange(2, 12)[None]
    # Inference on both sides: with gradients on, llmstack runs its hand-written training kernels,
    # which round differently from transformers' formulas (3.3e-6 on these logits).
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, adapted.eval()(ids).logits)


def test_a_full_fine_tune_of_a_llama_base_is_saved_as_llama(tmp_path):
    from transformers import LlamaForCausalLM

    to_llama(tiny_model()).save_pretrained(tmp_path / "base")
    trained = from_llama(load_model(str(tmp_path / "base")))  # what finetune trains
    save_in_base_format(trained, str(tmp_path / "model"), str(tmp_path / "base"), llama_base=True)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "llama"
    stock = LlamaForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = torch.arange(2, 12)[None]
    assert torch.allclose(stock(ids).logits, trained(ids).logits, atol=1e-5)


def test_configs_sft_yaml_names_sample_data_that_reads(tmp_path):
    from inference_fixtures import tiny_tokenizer

    from llmstack.training import load_run_config
    from llmstack.training.finetune.sft import SFTData

    tokenizer = tiny_tokenizer(tmp_path)
    run = load_run_config("configs/sft.yaml", [f"data.tokenizer={tmp_path}"])
    train, valid = (
        SFTData(path, tokenizer=tokenizer, seq_len=run.data.seq_len) for path in (run.data.train, run.data.valid)
    )
    assert train.num_blocks > 400 and valid.num_blocks > 30
