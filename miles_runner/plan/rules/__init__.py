"""Every cross-field rule, each a small function over the config and its derived values.

A rule yields Findings: the keys involved (dotted paths; the compiler shows each with its value and origin),
why the combination cannot work, and an override that fixes it. compile_plan runs all of them and reports
every finding at once. Rule ids are stable: tests and users refer to them.

Modules, one per section, in the order their rules run:
    base             Finding, the `rule` decorator, the RULES and PRECONDITIONS registries, shared key names
    sizes            counts are at least 1 (or 0): a precondition
    session          the session server and its pause mode (docs/system.md §1.2 rules 1-6)
    fully_async      fully-async rollout and the async schedule (rules 7-8)
    offload          training and rollout offload, optimizer storage (rules 9-15; more NOT_BUILT)
    weight_transfer  weight-transfer modes (rules 16-17)
    lora             LoRA modes and target modules (rules 18-25)
    multi_lora       multi-LoRA slots and per-adapter settings (rules 26-29)
    plugins          registered tasks, rewards and agents, and their data files
    routing_replay   routing and indexer replay
    cluster          what a cpu-only or GPU cluster can run, and the trainer's size
    arithmetic       parallel groups, engine placement and memory, batch splits, ports
    backends         settings only one backend honours; what this release has not built (NOT_BUILT)
    megatron         the Megatron trainer's LoRA paths, model families, layouts and refusals
    weight_sync      the adapter push cadence, the staleness it implies, and the checks of each push
    model            the model description matches its checkpoint, and its name can be served
    engine_build     a plan for stock SGLang uses no feature only the sglang-miles fork serves
    training         estimators, optimizer, trainer and rollout switches, metrics file (more NOT_BUILT)
    security         the run's key names an environment variable
    engine_limits    the embedded engine's request limits fit the rollout's requests; SGLang has none
    trainer_host     the trainer's own interpreter (trainer.python), and Megatron-Bridge's Python on a CPU cluster
"""

# Imported for their @rule registrations. Import order is registration order, which is the order problems are
# printed in (tests and golden outputs check it): sorting these imports would reorder every report.
# isort: off
from miles_runner.plan.rules import sizes, session, fully_async, offload, weight_transfer, lora  # noqa: F401
from miles_runner.plan.rules import multi_lora, plugins, routing_replay, cluster, arithmetic, backends  # noqa: F401
from miles_runner.plan.rules import megatron, weight_sync  # noqa: F401
from miles_runner.plan.rules import model, engine_build  # noqa: F401
from miles_runner.plan.rules import training, security, engine_limits, trainer_host  # noqa: F401

# isort: on
from miles_runner.plan.rules.base import PRECONDITIONS, RULES, Finding, RuleFn, rule

NOT_BUILT = backends.NOT_BUILT + megatron.NOT_BUILT + offload.NOT_BUILT + training.NOT_BUILT + trainer_host.NOT_BUILT

__all__ = ["NOT_BUILT", "PRECONDITIONS", "RULES", "Finding", "RuleFn", "rule"]
