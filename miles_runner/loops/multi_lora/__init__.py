"""The multi-LoRA training loop (docs/system.md §4.7, train_multi_lora_async.py): many adapters, one base model,
shared engines.

    controller service (plan.multi_lora.launch; under a Ray actor with executor=ray)
    -> producer (groups for every live adapter, always running)
    loop: reconcile (retire -> clean up -> load) -> push adapters that stepped or are new -> collect a batch
          -> record its adapters -> train -> mark it trained (only after a successful train) -> log, checkpoint

Engines that died are restarted before each push (at most `executor.engine_restarts` times each); an engine
that does not report the last pushed weight version is new (the run's start, a restart here or elsewhere), and
then every loaded adapter is pushed again, through a fresh weight-update group.

Bounded mode ends when no adapter is left to load, train or clean up (each retires itself after its num_step);
service mode waits for registrations instead. Every iteration appends a record to metrics.jsonl with
per-adapter namespaces (`{adapter}/reward/mean`, `{adapter}/train/loss`, `{adapter}/step`, ...), and a line to
multi_lora_events.jsonl (what was retired, loaded, cleaned up, pushed and trained, with each trained group's
stamps) for audits. Each adapter checkpoints into its own save folder (`<save>/checkpoints/step_N`: adapter,
optimizer, step, data cursor) and resumes from it when it is loaded again.

Modules:
    loop.py         MultiLoRALoop: wiring (clients, rollout, producer) and the step sequence above
    reconcile.py    the registry vs the trainer's slots: retire, clean up, load (the trainer gets the adapter's spec)
    recovery.py     engines that died: restart them, forgive a push they broke, tell new engines apart
    pushes.py       what is pushed and when: stepped or new adapters, every one to new engines; each push verified
    records.py      step records and per-adapter metrics, token rate, the tracker, per-adapter plots
    checkpoints.py  per-adapter save (periodic and final) and resume (step, data cursor)
    (multi_lora_events.jsonl is written through tracking/event_log.py)

Run it on a recorded plan: `python -m miles_runner.loops.run RUN_DIR [--resume]`.
"""

from miles_runner.loops.multi_lora.loop import MultiLoRALoop

__all__ = ["MultiLoRALoop"]
