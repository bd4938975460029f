"""Session errors and the HTTP status each one maps to (docs/system.md §2.3); the body is JSON {"error": msg}."""


class SessionError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SessionNotFoundError(SessionError):
    """Unknown session id, or the session is closing."""

    status_code = 404


class MessageValidationError(SessionError):
    """The request cannot extend the session: bad JSON, a deep rollback, a role that may not be appended."""

    status_code = 400


class TruncatedGenerationError(SessionError):
    """v2: the request extends a node whose generation stopped at the length limit."""

    status_code = 409


class TreeFullError(SessionError):
    """v2: the session already holds the maximum number of nodes."""

    status_code = 409


class TokenizationError(SessionError):
    """The stored token prefix is not a prefix of prompt+completion (beyond max_trim_tokens)."""

    status_code = 500


class UpstreamResponseError(SessionError):
    """The engine is unreachable, or answered 200 without what a training record needs."""

    status_code = 502


class TurnInProgressError(SessionError):
    """v1: a turn arrived while the session's previous turn is still being generated (one conversation, one
    turn at a time; a concurrent turn could only replace the other, so it is refused rather than lost)."""

    status_code = 409


class TooManySessionsError(SessionError):
    """The server already holds session.max_sessions open sessions."""

    status_code = 429


class ShuttingDownError(SessionError):
    """The server is stopping: new turns are refused and in-flight ones aborted."""

    status_code = 503
