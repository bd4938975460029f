"""Agents: multi-turn loops that talk to a chat endpoint (the session server's OpenAI API in a run).

An agent receives the task (the environment), one prompt and ``chat``, an async function from the message
list to the assistant's reply text; the caller wires ``chat`` to an OpenAI client pointed at the session
server, which records the turns and later assembles the training sample (``/samples``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles_runner.plugins.registry import Registry
from miles_runner.plugins.tasks import Message, Prompt, Task

ChatFn = Callable[[list[Message]], Awaitable[str]]


@dataclass(frozen=True)
class Episode:
    prompt: Prompt
    messages: list[Message]  # the whole conversation, prompt included
    replies: list[str]  # the assistant turns, in order


AgentFn = Callable[[Task, Prompt, ChatFn, int], Awaitable[Episode]]
AGENTS: Registry[AgentFn] = Registry("agent")


@AGENTS.register("feedback_loop")
@AGENTS.register("guess_number")
async def feedback_loop(task: Task, prompt: Prompt, chat: ChatFn, max_turns: int) -> Episode:
    """Reply, read the environment's feedback, repeat until it ends the episode or ``max_turns`` replies."""
    messages = list(prompt.messages)
    replies: list[str] = []
    for _ in range(max_turns):
        reply = await chat(messages)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        feedback = task.feedback(prompt, replies)
        if feedback is None:
            break
        messages.append({"role": "user", "content": feedback})
    return Episode(prompt, messages, replies)
