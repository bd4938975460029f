"""Tests of lora_mode=bridge (Megatron-Bridge on CPU): they run in the Python 3.12 side environment of make
bridge-env (.venv-bridge), and skip elsewhere."""
