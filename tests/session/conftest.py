import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir():
    from miles_runner.models.tiny_model import ensure_tiny_model

    return ensure_tiny_model("tiny-moe")


@pytest.fixture(scope="session")
def tito(tiny_model_dir):
    from miles_runner.session.tito import TitoTokenizer

    return TitoTokenizer.from_model_path(tiny_model_dir)


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir, tmp_path_factory):
    """The embedded engine with R3 on and the test adapter loaded as `miles_lora` and `__miles_slot_0`."""
    from servers import make_test_adapter, start_embedded_engine

    adapter_dir = make_test_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter"))
    process, url = start_embedded_engine(tiny_model_dir, adapter_dir, tmp_path_factory.mktemp("engine-logs"))
    yield url
    process.stop()


@pytest.fixture(scope="session")
def start_session_server(tiny_model_dir):
    """Start a session server (uvicorn in a thread) for `engine_url` with config overrides; stopped at exit."""
    from servers import ThreadedServer

    from miles_runner.session.app import create_app
    from miles_runner.session.config import SessionServerConfig

    started = []

    def start(engine_url: str, **overrides):
        config = SessionServerConfig(engine_url=engine_url, model_path=str(tiny_model_dir), **overrides)
        server = ThreadedServer(create_app(config)).start()
        started.append(server)
        return server

    yield start
    for server in started:  # all asked first, so their shutdowns overlap instead of adding up
        server.request_stop()
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def lora_server(engine_url, start_session_server):
    """v1, adapter on every turn, incremental R3."""
    return start_session_server(
        engine_url, lora_name="miles_lora", return_routed_experts=True, use_addition_r3=True, instance_id="i-1"
    )


@pytest.fixture(scope="session")
def base_server(engine_url, start_session_server):
    """v1, base model, full R3."""
    return start_session_server(engine_url, return_routed_experts=True)


@pytest.fixture(scope="session")
def tree_server(engine_url, start_session_server):
    """v2, adapter on every turn, incremental R3."""
    return start_session_server(
        engine_url, version="v2", lora_name="miles_lora", return_routed_experts=True, use_addition_r3=True
    )
