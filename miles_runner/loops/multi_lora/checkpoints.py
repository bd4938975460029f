"""Per-adapter checkpoints: each adapter saves into its own save folder (`<save>/checkpoints/step_N`: adapter,
optimizer, step, data cursor) and resumes from the latest one when it is loaded again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_runner.config.schema import CheckpointConfig
from miles_runner.loops.checkpoint import completed_steps, load_latest, save_checkpoint
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.trainer.interface import MultiLoRATrainer

Saved = tuple[dict[str, Any], dict[str, Any]]  # (trainer state, meta), as loops.checkpoint.load_latest returns


class AdapterCheckpoints:
    """Save and resume one adapter at a time: its trainer slot's state, its step and its data cursor."""

    def __init__(
        self,
        config: CheckpointConfig,
        trainer: MultiLoRATrainer,
        rollout: MultiLoRARollout,
        controller: ControllerClient,
    ) -> None:
        self.config, self.trainer, self.rollout, self.controller = config, trainer, rollout, controller

    @staticmethod
    def latest(run: AdapterRun) -> Saved | None:
        """The adapter's newest complete checkpoint, or None (a new adapter)."""
        return load_latest(Path(run.config.save))

    async def resume(self, name: str, meta: dict[str, Any]) -> None:
        """The controller counts the adapter's steps on from the checkpoint, and its prompts go on from there."""
        await self.controller.set_adapter_step(name, meta["step"])
        self.rollout.start_cursor(name, meta["cursor"])

    def save_if_due(self, run: AdapterRun, step: int) -> None:
        """Every `interval` steps of the adapter; its last step is saved when it is cleaned up."""
        if self.config.interval > 0 and step % self.config.interval == 0:
            self.save(run, step)

    def save_final(self, run: AdapterRun, step: int) -> None:
        """Before the adapter's slot is released (checkpoints on): its last step, unless already saved."""
        if self.config.interval > 0 and step > 0 and step not in completed_steps(Path(run.config.save)):
            self.save(run, step)

    def save(self, run: AdapterRun, step: int) -> None:
        meta = {"name": run.name, "cursor": self.rollout.cursors.get(run.name, 0)}
        state = self.trainer.state_dict(run.slot)
        save_checkpoint(Path(run.config.save), step, state, meta, keep_last=self.config.keep_last)
