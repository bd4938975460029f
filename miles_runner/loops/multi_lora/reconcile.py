"""The trainer's slots follow the controller's registry: retire (RETIRING -> CLEANUP, with prefix aborts),
clean up (final checkpoint, release the slot), then load what is new (resuming from its checkpoint)."""

from __future__ import annotations

from miles_runner.core.adapters import adapter_spec
from miles_runner.loops.multi_lora.checkpoints import AdapterCheckpoints
from miles_runner.loops.multi_lora.pushes import Pushes
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.tracking.event_log import EventLog
from miles_runner.trainer.interface import MultiLoRATrainer


class Reconciler:
    """Holds the adapters loaded in the trainer (`loaded`) and brings them in line with the registry."""

    def __init__(
        self,
        controller: ControllerClient,
        trainer: MultiLoRATrainer,
        rollout: MultiLoRARollout,
        pushes: Pushes,
        checkpoints: AdapterCheckpoints,
        events: EventLog,
        *,
        default_num_steps: int,
    ) -> None:
        self.controller, self.trainer, self.rollout = controller, trainer, rollout
        self.pushes, self.checkpoints, self.events = pushes, checkpoints, events
        self.default_num_steps = default_num_steps  # the plan's step count, for a generated task's num_step
        self.loaded: dict[str, AdapterRun] = {}  # adapters whose slot the trainer holds, as loaded

    async def reconcile(self, iteration: int) -> None:
        """Retire, clean up, then load what is new."""
        retired = await self.controller.retire_adapters()
        if retired:
            self.events.write(iteration, "retired", names=retired)
        snapshot = await self.controller.snapshot()
        for name in snapshot.cleanup:
            if name in self.loaded:
                self._clean_up(name, iteration)
            await self.controller.free_slot(name)
        wanted = {**snapshot.pending, **snapshot.active, **snapshot.retiring}
        for name in sorted(set(wanted) - set(self.loaded)):
            await self._load(wanted[name], iteration)

    async def _load(self, run: AdapterRun, iteration: int) -> None:
        """Into the trainer's slot, from the adapter's latest checkpoint if it has one; the engines get it next."""
        saved = self.checkpoints.latest(run)
        spec = adapter_spec(run.name, run.lora_name, run.config.to_dict())
        self.trainer.load_adapter(run.slot, spec, saved[0] if saved else None)
        if run.config.num_step is None:
            await self._resolve_num_step(run)
        if saved:
            await self.checkpoints.resume(run.name, saved[1])
        self.loaded[run.name] = run
        self.pushes.want([run.name])
        resumed_step = saved[1]["step"] if saved else None
        self.events.write(
            iteration,
            "loaded",
            name=run.name,
            slot=run.slot,
            registration_id=run.registration_id,
            resumed_step=resumed_step,
        )

    async def _resolve_num_step(self, run: AdapterRun) -> None:
        """No num_step given: an epoch of its data file; a generated task: the plan's step count."""
        rows = self.rollout.dataset_rows(run) or self.default_num_steps * run.config.rollout_batch_size
        await self.controller.resolve_num_step(run.name, rows)

    def _clean_up(self, name: str, iteration: int) -> None:
        """Final checkpoint (when checkpoints are on), then release the slot's adapter and optimizer."""
        run = self.loaded.pop(name)
        step = self.trainer.adapter_step(run.slot)  # counted on from the checkpoint it resumed from
        self.checkpoints.save_final(run, step)
        self.trainer.clear_adapter(run.slot)
        self.rollout.forget(name)
        self.pushes.forget(name)
        self.events.write(iteration, "cleaned_up", name=name, slot=run.slot)
