"""Megatron-core trainer: model core, HF conversion, parallel layout and the project's own LoRA on megatron."""
