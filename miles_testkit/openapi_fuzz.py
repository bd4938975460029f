"""Schemathesis against a live server, from the server's own OpenAPI schema (the reliability tests' fuzzer).

`fuzz_openapi(base_url, ...)` fetches `<base_url>/openapi.json` and runs schemathesis 4.x's engine (what
`schemathesis run` does: the coverage phase's boundary values, then Hypothesis fuzzing, both positive and negative
data) over every operation with five checks: no 5xx, documented status codes, documented content types, response
bodies and headers that match their schemas. It returns a `FuzzSummary`: requests sent per operation, the 5xx
answers, every check failure with a curl command that reproduces it, and engine errors (a network error, say a
server that died or closed a connection mid-answer). `assert_clean(summary)` is the pytest assertion.

Deterministic: a fixed seed, derandomized Hypothesis, no example database and no schemathesis cache, so a run sends
the same requests every time (and a failure seen once is seen again). `max_examples` bounds the fuzzing phase per
operation and mode; the coverage phase is bounded by the schema itself. Operations that would end the server (a
shutdown route) are left out by label, e.g. `exclude=("POST /shutdown",)`.

Use it only against servers on loopback that a test started: it sends thousands of malformed requests.

    summary = fuzz_openapi(server_url, token=key, max_examples=10, exclude=("POST /shutdown",))
    assert_clean(summary)            # fails with summary.report(): counts, requests per operation, each failure
    print(summary.counts())          # "<n> requests over <m> operations, 0 x 5xx, 0 schema violations, 0 errors"

A failure's curl shows `Authorization: [Filtered]` (schemathesis masks secrets): add the token to replay it.
`summary.statuses` counts the answers by status, so a test can also check that requests got past the auth check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import schemathesis
from schemathesis.config import CacheConfig, SchemathesisConfig
from schemathesis.engine import events, from_schema
from schemathesis.engine.recorder import ScenarioRecorder

# What a server owes every client: it answers every request, bad ones with a documented 4xx, and says what it returns.
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
)
SERVER_ERROR_CHECK = "not_a_server_error"
# Stateful testing follows links between operations, which our schemas do not declare; examples come first.
PHASES = ("examples", "coverage", "fuzzing")
MODES = ("positive", "negative")
DEFAULT_SEED = 15


@dataclass(frozen=True)
class FuzzFailure:
    """One failed check on one request: which operation, which check, the answer's status and how to replay it."""

    operation: str
    check: str
    status: int | None
    title: str
    message: str
    curl: str

    @property
    def is_server_error(self) -> bool:
        return self.check == SERVER_ERROR_CHECK

    def describe(self) -> str:
        return f"{self.operation}: {self.check} ({self.status}): {self.title}: {self.message.strip()}\n    {self.curl}"


@dataclass
class FuzzSummary:
    """What one fuzzing run sent and found. `server_errors` counts every 5xx answer; `failures` holds each failed
    check once per request (a 5xx usually fails two checks: not_a_server_error and status_code_conformance)."""

    base_url: str
    requests_per_operation: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int | None] = field(default_factory=Counter)  # None: no answer (a network error)
    server_errors: int = 0
    failures: list[FuzzFailure] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop_reason: str = ""

    @property
    def requests(self) -> int:
        return sum(self.requests_per_operation.values())

    @property
    def schema_violations(self) -> list[FuzzFailure]:
        """Failed checks other than the 5xx one: undocumented status codes, content types, bodies or headers."""
        return [failure for failure in self.failures if not failure.is_server_error]

    def failures_of(self, operation: str) -> list[FuzzFailure]:
        return [failure for failure in self.failures if failure.operation == operation]

    def counts(self) -> str:
        """The one-line figures for a closing note."""
        return (
            f"{self.requests} requests over {len(self.requests_per_operation)} operations, "
            f"{self.server_errors} x 5xx, {len(self.schema_violations)} schema violations, {len(self.errors)} errors"
        )

    def report(self, limit: int = 20) -> str:
        """Counts, requests per operation, then up to `limit` failures and every engine error."""
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(self.statuses.items(), key=str))
        lines = [f"{self.base_url}: {self.counts()} (stop: {self.stop_reason}; answers {statuses})"]
        lines += [f"  {count:5d}  {operation}" for operation, count in sorted(self.requests_per_operation.items())]
        lines += [failure.describe() for failure in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more failed checks")
        lines += [f"error: {error}" for error in self.errors]
        return "\n".join(lines)


def fuzz_openapi(
    base_url: str,
    *,
    token: str | None = None,
    max_examples: int = 20,
    exclude: Iterable[str] = (),
    seed: int = DEFAULT_SEED,
    phases: Sequence[str] = PHASES,
    modes: Sequence[str] = MODES,
    request_timeout: float = 30.0,
    parameters: Mapping[str, str] | None = None,
) -> FuzzSummary:
    """Fuzz every operation of the server at `base_url` (its schema at `/openapi.json`) but the `exclude`d labels
    ("METHOD /path" as in the schema), sending `Authorization: Bearer <token>` when a token is given.
    `parameters` fixes named parameters in every request, e.g. {"path.session_id": id} to fuzz one live object."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    config = _config(seed, max_examples, phases, modes, request_timeout, headers)
    if parameters:
        config.projects.override.update(parameters=dict(parameters))
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config, headers=headers, timeout=30)
    schema.config.update(base_url=base_url)
    excluded = list(exclude)
    if excluded:
        schema = schema.exclude(name=excluded)
    return _summarise(base_url, from_schema(schema).execute())


def assert_clean(summary: FuzzSummary, *, min_requests: int = 1) -> None:
    """Pytest assertion: no 5xx, no schema violation, no engine error, and the run really sent requests."""
    assert summary.requests >= min_requests, f"fuzzing sent {summary.requests} requests\n{summary.report()}"
    clean = summary.server_errors == 0 and not summary.failures and not summary.errors
    assert clean, summary.report()


def _config(
    seed: int,
    max_examples: int,
    phases: Sequence[str],
    modes: Sequence[str],
    request_timeout: float,
    headers: dict[str, str],
) -> SchemathesisConfig:
    # The cache would carry what one run learnt into the next and so change which requests it sends.
    config = SchemathesisConfig(seed=seed, cache=CacheConfig(enabled=False))
    project = config.projects.override
    # Go on after a failure so that one run reports every failing operation and request, not only the first.
    project.update(continue_on_failure=True, request_timeout=request_timeout, headers=headers or None)
    project.phases.update(phases=list(phases))
    project.checks.update(included_check_names=list(CHECKS))
    project.generation.update(
        modes=list(modes), max_examples=max_examples, deterministic=True, database="none", no_shrink=True
    )
    return config


def _summarise(base_url: str, stream: Iterable[events.EngineEvent]) -> FuzzSummary:
    summary = FuzzSummary(base_url=base_url)
    for event in stream:
        if isinstance(event, events.ScenarioFinished):
            _record_scenario(summary, event.recorder)
        elif isinstance(event, events.NonFatalError):
            summary.errors.append(f"{event.label}: {event.info.title}: {event.info.message}")
        elif isinstance(event, events.FatalError):
            summary.errors.append(f"fatal: {event.exception!r}")
        elif isinstance(event, events.EngineFinished):
            summary.stop_reason = str(event.stop_reason)
    return summary


def _record_scenario(summary: FuzzSummary, recorder: ScenarioRecorder) -> None:
    for interaction in recorder.interactions.values():
        status = interaction.response.status_code if interaction.response is not None else None
        summary.requests_per_operation[recorder.label] += 1
        summary.statuses[status] += 1
        if status is not None and status >= 500:
            summary.server_errors += 1
    for case_id, checks in recorder.checks.items():
        interaction = recorder.interactions.get(case_id)
        status = interaction.response.status_code if interaction and interaction.response else None
        for check in checks:
            if check.failure_info is None:
                continue
            failure = check.failure_info.failure
            summary.failures.append(
                FuzzFailure(
                    operation=recorder.label,
                    check=check.name,
                    status=status,
                    title=failure.title,
                    message=failure.message,
                    curl=check.failure_info.code_sample,
                )
            )
