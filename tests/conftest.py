"""Test-wide environment: everything stays on loopback and offline, and built tiny models are cached once in
the checkout (`.cache/`, as `make` sets it) instead of in the user's cache folder."""

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MILES_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# One intra-op thread in every test process (read by torch when it first computes; children inherit it), as the
# engine and the trainer ranks already use: with two, each op waits at an OpenMP barrier for the core the other
# worker holds, which slows a compute-heavy test (the in-process GRPO proof) several times beside a busy core.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Under pytest-xdist each worker's Ray clusters keep their session files (and `ray_current_cluster`, which
# `address="auto"` reads) in a folder of their own, so that one worker's run never finds another's cluster.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(Path(os.environ["RAY_TMPDIR"]) / "ray", exist_ok=True)  # Ray writes its address file there first

# A suite started as a background job (`make test &`, nohup) inherits SIGINT ignored, and so would every process it
# starts: the Ctrl-C tests send SIGINT to a run and expect what a terminal's Ctrl-C does. Python's handler here
# resets to the default in each child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The shared fixtures that start a server process (tests/*/conftest.py). A test that uses one, directly or through
# another fixture, is an integration test, which `make test-fast` leaves out; modules that start processes their
# own way carry `pytestmark = pytest.mark.integration`.
SERVER_FIXTURES = frozenset(
    {
        "engine",
        "plain_engine",
        "contract_engine_url",
        "lora_engine",
        "engine_url_for_sync",
        "engine_url",
        "start_session_server",
        "slurm_cluster",
    }
)


MEMO_FOLDER = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # The xdist controller makes the run's folder of composed configs (tests/compiled.py) before its workers start,
    # which inherit the variable; a single process keeps its memo to itself. Imported here: the Megatron-Bridge
    # side venv (make bridge-test) has no Hydra, and runs in one process.
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        from tests.compiled import MEMO_ENV

        os.environ[MEMO_ENV] = config.stash[MEMO_FOLDER] = tempfile.mkdtemp(prefix="miles-compose-memo-")
    if not hasattr(config, "workerinput"):
        build_tiny_models(config)


def build_tiny_models(config: pytest.Config) -> None:
    """The tiny models the tests run, built before any test starts (as `make tiny-models` does): a pytest run on a
    fresh clone would otherwise build one inside the first test that needs it, against that test's timeout, and
    workers would build it side by side. A no-op once built; skipped for the unit tests alone (they load no model)
    and in the Megatron-Bridge side venv, whose models the main venv builds."""
    if "not integration" in (config.option.markexpr or "") or importlib.util.find_spec("hydra") is None:
        return
    from miles_runner.models.format_pretrain import ensure_format_pretrained
    from miles_runner.models.tiny_model import ensure_tiny_model

    ensure_tiny_model("tiny-dense")
    ensure_tiny_model("tiny-glm5")
    ensure_format_pretrained("tiny-moe")
    ensure_format_pretrained("tiny-glm5")


def pytest_unconfigure(config: pytest.Config) -> None:
    if folder := config.stash.get(MEMO_FOLDER, None):
        from tests.compiled import MEMO_ENV

        os.environ.pop(MEMO_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The Slurm jobs' file first, then files with a `slow` test (the order within a file kept): `make test` hands whole
    # files to its workers in this order, so the long ones start at once instead of leaving one worker busy at the
    # end. The Slurm file is long, much of it waiting on the scheduler and the jobs' start-up: run last, it kept one
    # worker busy alone while the other had nothing left, and its waits left a core idle.
    slurm_files = {item.path for item in items if item.get_closest_marker("slurm")}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slurm_files, item.path not in slow_files))
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


PROCESS_MARKERS = ("integration", "slow", "slurm")
RUNNING_BEFORE = pytest.StashKey[list]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "miles_runner.procs.process" in sys.modules:
        from miles_runner.procs.process import running_processes

        item.stash[RUNNING_BEFORE] = running_processes()


LAST_TEST = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    item.stash[LAST_TEST] = nextitem is None  # read by overlap_final_shutdowns, torn down right after


@pytest.fixture(autouse=True)
def overlap_final_shutdowns(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a worker's last test its session's shared servers stop, each fixture's stop() waiting for its own
    shutdown, one after another. Signalled together, the shutdowns overlap. Only those that ran before this test
    began, and only once the test's function-scoped fixtures are torn down: an autouse fixture is set up before the
    test's other function-scoped ones, so it is torn down after them (a fixture's cleanup may still call a shared
    server), and before the module- and session-scoped ones that stop those servers."""
    yield
    if request.node.stash.get(LAST_TEST, False):
        for process in request.node.stash.get(RUNNING_BEFORE, []):
            process.terminate()  # a no-op for one stopped meanwhile


@pytest.fixture(scope="session", autouse=True)
def warm_start_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The runner's Python components that the tests start (engines, session servers, trainer ranks, ...) fork
    from one warm start server per test process (miles_runner/procs/warm.py), which has imported torch,
    transformers and the rest once: an engine is healthy in a fraction of the time a cold start's imports take.
    Only where a selected test starts processes; MILES_WARM_START=off starts every component cold, as a plain run
    does. Its log (each child it forked, and why any started cold) is kept in pytest's base temporary folder."""
    wanted = any(item.get_closest_marker(m) for item in request.session.items for m in PROCESS_MARKERS)
    if os.environ.get("MILES_WARM_START") is not None or not wanted:  # a server of the caller's, or "off"
        yield
        return
    from miles_runner.procs.process import start_warm_server

    folder = Path(tempfile.mkdtemp(prefix="miles-warm-"))  # short: a Unix socket's path has at most 107 bytes
    log_path = tmp_path_factory.getbasetemp() / f"warm-start-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"
    # The runner's modules, and the tests' own (worker ranks: tests/trainer/ranks_helper.py).
    server = start_warm_server(folder / "warm.sock", log_path, "--modules", "miles_runner.", "tests.")
    os.environ["MILES_WARM_START"] = str(folder / "warm.sock")
    try:
        yield
    finally:
        os.environ.pop("MILES_WARM_START", None)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    """monkeypatch for a module-scoped fixture (e.g. a server started with a variable set for its whole module)."""
    with pytest.MonkeyPatch.context() as patch:
        yield patch
