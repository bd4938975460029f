"""Tests of the Megatron trainer (megatron-core on CPU, gloo)."""
