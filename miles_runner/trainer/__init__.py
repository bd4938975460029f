"""Trainers: the GRPO/PPO policy loss (`loss`), shared by every backend, and the FSDP + peft trainer (`fsdp`).

Import the submodules directly; this package imports nothing heavy so the plan compiler can name it freely.
"""
