"""`python -m miles_runner.procs.warm_exec <python> -m miles_runner.<module> ARGS...`: that command, forked by the
warm start server that MILES_WARM_START names (procs/warm.py), with this process's stdin, stdout and stderr.

This process stands in for it: the signals it gets go to the command, and it exits as the command does (a command
ended by signal N ends it by signal N). Killed itself (SIGKILL), its connection closes and the server kills the
command. Where the command cannot start warm, this process becomes it (exec), as a cold start. A caller that
starts runs over and over (the test suite, where a cold driver spends most of its CPU importing torch and the rest)
puts this in front of the command and changes nothing else: pipes, Popen.send_signal and exit codes all hold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from miles_runner.procs.warm import warm_start

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
STDIO = (0, 1, 2)


class Forwarder:
    """Signals for the child: forwarded once its pid is known, held until then."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.held: list[int] = []

    def __call__(self, signum: int, _frame: object = None) -> None:
        if self.pid is None:
            self.held.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def attach(self, pid: int) -> None:
        self.pid = pid
        for signum in self.held:
            self(signum)
        self.held.clear()


def exit_like(returncode: int) -> int:
    """This process's end as the child's: its exit code, or death by its signal."""
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print(__doc__.split("\n")[0], file=sys.stderr)
        return 2
    forward = Forwarder()
    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    child = warm_start(command, os.environ, os.getcwd(), None, STDIO)
    if child is None:  # a cold start: this process becomes the command
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for held in forward.held:  # what came while the server was asked ends it, as before a command's start
            exit_like(-held)
        os.execv(command[0], command)
    forward.attach(child.pid)
    return exit_like(child.wait())


if __name__ == "__main__":
    sys.exit(main())
