"""Supervised fine-tuning: the run (.run: full, LoRA or prompt tuning through the pretraining
Trainer), its prompt/response data (.sft) and the peft adapters (.lora)."""
