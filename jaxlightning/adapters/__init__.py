"""Adapters that fine-tune a pretrained model through a few new weights,
the pretrained ones frozen: LoRA (`lora.LoRA`)."""
