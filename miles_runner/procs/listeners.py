"""Who listens on a TCP port, read from /proc (Linux): the proof that a server answering its health check is the
one the runner started, and the name of whoever holds the port instead.

A health answer proves that *a* server listens, not which one. A port checked free before the start can be taken by
another run's server in the moment before ours binds it; ours then exits ("address already in use") while the other
one answers our probes, and a run that trusted the answer would send its rollouts and adapters there. So a server
counts as ours only when every socket listening where its health URL connects (its address, or a wildcard) is held
by the process started or by one of its descendants (SGLang and the router may bind in a child). This works for any
server, real SGLang included, which takes no token to prove itself with; it must run on the server's own host,
where the process started. Where /proc/net/tcp cannot be read (not Linux) nothing is proven: ManagedProcess then
trusts the health answer, as it did before, and warns once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import socket
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # the kernel's TCP_LISTEN state, as the tables print it
_PROC = Path("/proc")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class TcpSocket:
    """A row of /proc/net/tcp{,6}: a socket with an owner (a TIME_WAIT entry has none, and is left out)."""

    address: IPAddress
    port: int
    listening: bool
    uid: int
    link: str  # "socket:[inode]", as the holders' /proc/<pid>/fd/* links read


@dataclass(frozen=True)
class PortOwners:
    """The sockets listening where a connection to a server's host and port arrives: `ours` of them held by the
    started process tree, and the holders of the others ("pid N (command)", or "another process ...")."""

    ours: int
    others: tuple[str, ...]


def tcp_sockets() -> list[TcpSocket] | None:
    """Every TCP socket with an owner in this network namespace; None where no table can be read (not Linux)."""
    rows, readable = [], False
    for table in TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        rows += [row for line in lines if (row := parse_row(line.split()))]
    return rows if readable else None


def parse_row(fields: list[str]) -> TcpSocket | None:
    """sl, local_address (hex ip:port), rem_address, st, tx:rx, tr:when, retrnsmt, uid, timeout, inode, ..."""
    if len(fields) < 10 or fields[9] == "0":
        return None
    address, port = fields[1].rsplit(":", 1)
    listening, link = fields[3] == _LISTEN, f"socket:[{fields[9]}]"
    return TcpSocket(_hex_address(address), int(port, 16), listening, int(fields[7]), link)


def _hex_address(text: str) -> IPAddress:
    """The kernel prints each 32-bit word of an address as a number in this host's byte order."""
    words = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
    return ipaddress.ip_address(b"".join(struct.pack("=I", word) for word in words))


def reaches(listener: IPAddress, targets: Collection[IPAddress]) -> bool:
    """Whether a connection to one of `targets` may arrive at a socket listening on `listener`: the same address, a
    wildcard (`::` counted for IPv4 too: a dual-stack socket takes both), or an IPv4 address mapped into IPv6."""
    if listener.is_unspecified or any(target.is_unspecified for target in targets):
        return True
    if isinstance(listener, ipaddress.IPv6Address) and listener.ipv4_mapped:
        listener = listener.ipv4_mapped
    return listener in targets


def host_addresses(host: str) -> set[IPAddress]:
    """The addresses a client connecting to `host` may use (a name resolves to several)."""
    with contextlib.suppress(ValueError):
        return {ipaddress.ip_address(host.strip("[]"))}
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}


def listener_owners(host: str, port: int, root: int) -> PortOwners | None:
    """Who holds the sockets listening where a connection to `host:port` arrives, as seen from process `root`'s
    tree (it, its descendants, its process group); None where /proc's tables cannot be read."""
    found = tcp_sockets()
    if found is None:
        return None
    targets = host_addresses(host)
    links = {s.link: s.uid for s in found if s.listening and s.port == port and reaches(s.address, targets)}
    ours = held_links(process_tree(root), links)
    others = {link: uid for link, uid in links.items() if link not in ours}
    return PortOwners(len(ours), tuple(describe_holders(others)))


def process_tree(root: int) -> set[int]:
    """`root`, its descendants, and the rest of its process group (children left behind by a leader that died)."""
    children: dict[int, list[int]] = {}
    tree = {root}
    for pid, ppid, group in _process_table():
        children.setdefault(ppid, []).append(pid)
        if group == root:
            tree.add(pid)
    frontier = list(tree)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return tree


def _process_table() -> Iterable[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process visible here."""
    for stat in _PROC.glob("[0-9]*/stat"):
        try:
            ppid, group = stat.read_text().rsplit(")", 1)[1].split()[1:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        yield int(stat.parent.name), int(ppid), int(group)


def held_links(pids: Iterable[int], links: Collection[str]) -> set[str]:
    """Which of `links` (socket:[inode]) the processes `pids` hold open."""
    held: set[str] = set()
    for pid in pids:
        held.update(link for link in _open_links(_PROC / str(pid)) if link in links)
    return held


def describe_holders(links: dict[str, int]) -> list[str]:
    """Who holds each of `links` (socket:[inode] -> the socket's uid): "pid N (command)" for each process seen with
    it open; a socket whose holder cannot be inspected (another user's) as "another process ..." with its user."""
    names, seen = [], set()
    for proc in _PROC.iterdir() if links else ():
        if proc.name.isdigit() and (held := links.keys() & _open_links(proc)):
            names.append(describe_process(proc))
            seen |= held
    unseen_uids = sorted({uid for link, uid in links.items() if link not in seen})
    return names + [f"another process ({_user(uid)}) that this user cannot inspect" for uid in unseen_uids]


def describe_process(proc: Path) -> str:
    return f"pid {proc.name} ({command_line(proc)})"


def command_line(proc: Path, limit: int = 160) -> str:
    try:
        text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open_links(proc: Path) -> set[str]:
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:  # gone meanwhile, or not ours to look at
        return set()
    links = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            links.add(os.readlink(fd))
    return links


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
