"""Free loopback ports for the servers the runner starts."""

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` right now (the OS picks it; bind it soon, another process may)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_block(count: int, host: str = LOOPBACK, attempts: int = 50) -> int:
    """A base port B with B .. B+count-1 all free right now (engines take consecutive ports from a base)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count <= 65536 and all(port_is_free(host, base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no block of {count} free consecutive ports found on {host}")


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (SO_REUSEADDR, as servers set it: TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
