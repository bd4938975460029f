"""The guess-number agent loop: reply, environment feedback, repeat until the episode ends."""

from miles_runner.plugins.agents import feedback_loop
from miles_runner.plugins.rewards import guess_number
from miles_runner.plugins.tasks import GuessNumberTask


def _scripted(replies):
    """A deterministic policy standing in for the chat endpoint: returns the given replies in order."""
    pending = list(replies)

    async def chat(messages):
        return pending.pop(0)

    return chat


async def test_episode_follows_feedback_until_the_hit():
    task = GuessNumberTask(seed=0)
    prompt = task.prompt(0)
    secret = int(prompt.label)
    wrong = 0 if secret > 0 else 9
    episode = await feedback_loop(task, prompt, _scripted([str(wrong), str(secret), "never asked"]), 3)
    assert episode.replies == [str(wrong), str(secret)]
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user", "assistant"]
    assert episode.messages[2]["content"] in ("Higher.", "Lower.")
    assert guess_number(prompt, episode.replies) == 0.8


async def test_episode_stops_at_the_turn_limit():
    task = GuessNumberTask(seed=0)
    episode = await feedback_loop(task, task.prompt(0), _scripted(["x"] * 5), 2)
    assert len(episode.replies) == 2
