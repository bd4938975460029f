"""session.tito_model: a named TITO family fixes the chat template, pins its kwargs and joins each turn's suffix to
the stored ids by its own rule (miles' TITOTokenizer families); a family the model's tokenizer cannot serve stops
the server at start."""

import subprocess
import sys

import pytest
from servers import chat, get_session, new_session
from transformers import AutoTokenizer

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_runner.session.app import create_app
from miles_runner.session.config import SessionServerConfig
from miles_runner.session.errors import MessageValidationError
from miles_runner.session.tito import Glm47Tito, TitoTokenizer

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is 3 plus 4?"}
ANSWER = {"role": "assistant", "content": "The answer is 7."}
TOOL = {"role": "tool", "content": "7", "tool_call_id": "c1"}
QWEN3_TOOL_TURN = "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

# A GLM-4.7-shaped template (role tokens open each message; an assistant turn has no closing token: the model
# stops by emitting the next message's opener) on the tiny tokenizer with GLM's role tokens added.
GLM_SHAPED_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}{{- '<|observation|>\\n' + m.content }}"
    "{%- else %}{{- '<|' + m.role + '|>\\n' + m.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return TitoTokenizer.from_model_path(tiny_model_dir, "qwen3")


@pytest.fixture(scope="module")
def glm_shaped(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|observation|>", "<|assistant|>"]})
    tokenizer.chat_template = GLM_SHAPED_TEMPLATE
    return Glm47Tito(tokenizer)


def test_qwen3_renders_the_first_turn_like_the_chatml_template(qwen3, tito):
    assert qwen3.first_turn_ids([SYSTEM, USER], None, {}) == tito.first_turn_ids([SYSTEM, USER], None, {})


def test_qwen3_adds_the_newline_the_model_does_not_generate_after_im_end(qwen3):
    stored = [*qwen3.first_turn_ids([SYSTEM, USER], None, {}), *qwen3.encode("The answer is 7."), qwen3.im_end_id]
    merged = qwen3.merge_tokens([SYSTEM, USER, ANSWER], stored, [TOOL], None, {})
    assert merged[: len(stored)] == stored
    assert qwen3.decode(merged[len(stored) :]) == "\n" + QWEN3_TOOL_TURN  # its fixed template's tool turn


def test_qwen3_appends_to_a_turn_cut_short_without_closing_it(qwen3):
    stored = [*qwen3.first_turn_ids([SYSTEM, USER], None, {}), *qwen3.encode("The answer")]
    merged = qwen3.merge_tokens([SYSTEM, USER, ANSWER], stored, [TOOL], None, {})
    assert qwen3.decode(merged[len(stored) :]) == QWEN3_TOOL_TURN


def test_qwen3_allows_appending_an_assistant_message_and_default_does_not(qwen3, tito):
    stored = qwen3.first_turn_ids([SYSTEM, USER], None, {})
    merged = qwen3.merge_tokens([SYSTEM, USER, ANSWER], stored, [ANSWER, USER], None, {})
    assert qwen3.decode(merged[len(stored) :]).startswith("<|im_start|>assistant\n<think>")
    with pytest.raises(MessageValidationError, match="role 'assistant' cannot be appended"):
        tito.merge_tokens([SYSTEM, USER, ANSWER], stored, [ANSWER, USER], None, {})


def test_qwen3_pins_clear_thinking_off(qwen3):
    history = [SYSTEM, USER, {**ANSWER, "reasoning_content": "3 + 4"}, {"role": "user", "content": "Thanks"}]
    assert "<think>\n3 + 4\n</think>" in qwen3.render(
        history, tools=None, add_generation_prompt=False, template_kwargs={}
    )
    with pytest.raises(MessageValidationError, match="clear_thinking=True conflicts with tito_model qwen3"):
        qwen3.first_turn_ids([SYSTEM, USER], None, {"clear_thinking": True})


def test_glm47_drops_a_stored_turn_opener_the_suffix_opens_again(glm_shaped):
    observation = glm_shaped.token_id("<|observation|>")
    stored = [*glm_shaped.first_turn_ids([SYSTEM, USER], None, {}), *glm_shaped.encode("Let me check"), observation]
    merged = glm_shaped.merge_tokens([SYSTEM, USER, ANSWER], stored, [TOOL], None, {})
    assert merged[: len(stored) - 1] == stored[:-1]
    assert glm_shaped.decode(merged[len(stored) - 1 :]) == "<|observation|>\n7<|assistant|>\n"


def test_glm47_keeps_a_stored_turn_that_ends_otherwise(glm_shaped):
    stored = [*glm_shaped.first_turn_ids([SYSTEM, USER], None, {}), *glm_shaped.encode("Let me check")]
    merged = glm_shaped.merge_tokens([SYSTEM, USER, ANSWER], stored, [TOOL], None, {})
    assert merged[: len(stored)] == stored


def test_a_family_whose_tokens_the_model_lacks_stops_the_server_at_start(tiny_model_dir, engine_url):
    config = SessionServerConfig(
        engine_url=engine_url, model_path=str(tiny_model_dir), tito_model="glm47", max_trim_tokens=1
    )
    with pytest.raises(ValueError, match=r"tito_model glm47 needs the tokens \['<\|user\|>'"):
        create_app(config)


def test_glm47_needs_room_to_drop_the_boundary_token(tiny_model_dir):
    with pytest.raises(ValueError, match="max_trim_tokens must be at least that"):
        SessionServerConfig(engine_url="http://127.0.0.1:1", model_path=str(tiny_model_dir), tito_model="glm47")


# ---- through the session server (embedded engine, tiny model) ----


@pytest.fixture(scope="module")
def family_servers(engine_url, start_session_server):
    return {name: start_session_server(engine_url, tito_model=name) for name in ("default", "qwen3")}


def tool_turn_suffix(server, tokenizer) -> str:
    """Turn 1, then a tool result: the text the second prompt adds after turn 1's stored ids."""
    session_id = new_session(server)
    reply = chat(server, session_id, [SYSTEM, USER])
    assert reply.status_code == 200, reply.text
    answer = {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]}
    assert chat(server, session_id, [SYSTEM, USER, answer, TOOL]).status_code == 200
    first, second = get_session(server, session_id)["records"]
    stored = first["request"]["input_ids"] + [
        t[1] for t in first["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
    ]
    assert second["request"]["input_ids"][: len(stored)] == stored
    return tokenizer.decode(second["request"]["input_ids"][len(stored) :]), stored


def test_the_qwen3_server_renders_tool_results_with_its_fixed_template(family_servers, qwen3):
    suffix, stored = tool_turn_suffix(family_servers["qwen3"], qwen3)
    assert suffix == ("\n" if stored[-1] == qwen3.im_end_id else "") + QWEN3_TOOL_TURN


def test_the_default_server_renders_tool_results_with_the_models_template(family_servers, tito):
    suffix, _ = tool_turn_suffix(family_servers["default"], tito)
    assert suffix.endswith("<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")


def test_the_qwen3_server_refuses_a_request_that_unpins_its_kwargs(family_servers):
    server = family_servers["qwen3"]
    reply = chat(server, new_session(server), [SYSTEM, USER], chat_template_kwargs={"clear_thinking": True})
    assert reply.status_code == 400
    assert "conflicts with tito_model qwen3" in reply.json()["error"]


def server_argv(engine_url: str, model_dir, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles_runner.session.server",
        "--engine-url",
        engine_url,
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        *flags,
    ]


def test_the_standalone_server_exits_at_start_for_a_family_its_model_cannot_serve(engine_url, tiny_model_dir):
    argv = server_argv(engine_url, tiny_model_dir, free_port(), "--tito-model", "glm47", "--max-trim-tokens", "1")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "tito_model glm47 needs the tokens" in result.stderr


def test_the_standalone_server_warns_at_start_that_default_is_best_effort(engine_url, tiny_model_dir, tmp_path):
    port = free_port()
    process = ManagedProcess(
        "session-server",
        server_argv(engine_url, tiny_model_dir, port),
        log_path=tmp_path / "session.log",
        health_url=f"http://127.0.0.1:{port}/health",
        startup_timeout_s=120,
    )
    with process:
        assert "tito_model default: the model's own chat template" in (tmp_path / "session.log").read_text()


@pytest.mark.parametrize("family", ["qwen3", "glm_shaped"])
def test_a_family_encodes_as_its_tokenizer_does(family, request):
    tito = request.getfixturevalue(family)
    for text in ("<|user|>\nhi<|assistant|>\n<think></think>ok<|observation|>", "<|im_start|>user\n7<|im_end|>\n"):
        assert tito.encode(text) == tito.tokenizer.encode(text, add_special_tokens=False)
