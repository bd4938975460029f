"""LoRA: adapter naming, target modules, export, weight sync and multi-LoRA (heavy imports stay in submodules)."""
