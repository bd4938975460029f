"""miles-runner: declarative RL post-training of LoRA adapters with SGLang rollouts."""
