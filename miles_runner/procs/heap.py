"""The start-up heap of a long-lived component, frozen out of Python's garbage collections.

A component imports torch, transformers, FastAPI and the rest (hundreds of thousands of objects the collector tracks),
then serves or trains for the rest of its life. Each full collection walked all of them again, and the driver, engine
and session server allocate enough per step to trigger one every few steps. Freezing them once the component has started
(gc.freeze: they move to a generation no collection visits) leaves the collector what the work itself allocates, so a
run spends less CPU collecting. What is frozen is alive for the process's life anyway (modules, the model, the app);
garbage made while starting is collected first.
"""

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
