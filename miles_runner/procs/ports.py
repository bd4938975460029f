"""Free loopback ports for the servers the runner starts.

A port is picked now and bound later, sometimes minutes later (a Slurm job's plan fixes its ports at submission).
Ports the kernel hands out itself (bind to port 0) come from its ephemeral range, which is also where every outgoing
connection gets its local port: a client of any process on the host could hold the picked port by the time the
server binds it ("address already in use"). So ports are picked at random below that range, where only listeners
live, and one process never hands out the same port twice.
"""

import functools
import random
import socket
from collections.abc import Collection
from pathlib import Path

from miles_runner.procs.listeners import describe_holders, tcp_sockets

LOOPBACK = "127.0.0.1"
ANY_ADDRESS = "0.0.0.0"  # a port free here is free on every address of the host
# The lowest port picked: above Ray's default worker ports (10002-19999, which Ray refuses to see any of its own
# components on: a GCS port picked there fails `ray start`) and the registered services of most hosts.
LISTEN_PORTS_FROM = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
ATTEMPTS = 200

_pick = random.SystemRandom()  # not the `random` module's generator: runs seed it, so two runs would pick alike
_handed_out: set[tuple[str, int]] = set()


@functools.cache  # read once per process: the kernel's range is a host setting
def listen_port_range() -> range:
    """The ports picked from: below the kernel's ephemeral range, or none where that leaves too few."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    return range(LISTEN_PORTS_FROM, max(LISTEN_PORTS_FROM, ephemeral_low))


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` right now and that this process has not handed out before."""
    return free_port_block(1, host)


def free_ports(count: int, host: str = LOOPBACK, avoid: Collection[int] = ()) -> list[int]:
    """`count` distinct free ports, none of `avoid` (ports that something will bind later)."""
    return [free_port_block(1, host, avoid=avoid) for _ in range(count)]


def free_port_block(count: int, host: str = LOOPBACK, attempts: int = ATTEMPTS, avoid: Collection[int] = ()) -> int:
    """A base port B with B .. B+count-1 all free right now (engines take consecutive ports from a base), none of
    them in `avoid`."""
    candidates = listen_port_range()
    for _ in range(attempts):
        base = _pick.choice(candidates) if len(candidates) > count else _kernel_port(host)
        block = [(host, base + i) for i in range(count)]
        if (
            base + count <= 65536
            and not _handed_out.intersection(block)
            and not any(p in avoid for _, p in block)
            and all(port_is_free(*p) for p in block)
        ):
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no block of {count} free consecutive ports found on {host}")


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (SO_REUSEADDR, as servers set it: TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def address_answers(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at `address` (host:port) now: a server there, not a free port."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def port_holders(port: int) -> list[str]:
    """Who holds TCP `port` on this host: "pid N (command)" for each process with a socket bound to it, "another
    process (user ...)" for a socket whose holder this user cannot inspect; read from /proc (Linux; none where it
    cannot be read). For error messages only: it looks at every process's open files."""
    links = {s.link: s.uid for s in tcp_sockets() or () if s.port == port}
    return describe_holders(links)
