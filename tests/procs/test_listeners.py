"""Reading who listens on a port from /proc: the kernel's table rows, which listeners a connection reaches, and who
holds a socket (tests/procs/test_port_owner.py starts the servers)."""

import ipaddress
import os
import socket
import struct

from miles_runner.procs.listeners import (
    PortOwners,
    describe_holders,
    listener_owners,
    parse_row,
    process_tree,
    reaches,
)
from miles_runner.procs.ports import LOOPBACK, free_port

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address


def kernel_hex(address: str) -> str:
    """An address as /proc/net/tcp{,6} prints it: each 32-bit word as a number in this host's byte order."""
    packed = ipaddress.ip_address(address).packed
    return "".join(f"{word:08X}" for (word,) in struct.iter_unpack("=I", packed))


def row(address: str, port: int, state: str, inode: str = "4242", uid: int = 1000) -> list[str]:
    local, remote = f"{kernel_hex(address)}:{port:04X}", f"{kernel_hex(address)}:0000"
    return ["0:", local, remote, state, "00000000:00000000", "00:00000000", "00000000", str(uid), "0", inode]


def unused_pid() -> int:
    taken = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    return next(pid for pid in range(max(taken) + 1, 1 << 22) if pid not in taken)


def test_a_row_is_read_in_the_hosts_byte_order_for_both_address_families():
    v4, v6 = parse_row(row("127.0.0.1", 30000, "0A")), parse_row(row("::1", 30001, "01", uid=7))
    assert v4 is not None and (v4.address, v4.port, v4.listening, v4.link) == (
        V4("127.0.0.1"),
        30000,
        True,
        "socket:[4242]",
    )
    assert v6 is not None and (v6.address, v6.port, v6.listening, v6.uid) == (V6("::1"), 30001, False, 7)


def test_a_time_wait_row_has_no_owner_and_is_left_out():
    assert parse_row(row("127.0.0.1", 30000, "06", inode="0")) is None


def test_a_connection_reaches_a_listener_on_its_address_a_wildcard_or_its_ipv6_mapping():
    loopback = {V4("127.0.0.1")}
    assert reaches(V4("127.0.0.1"), loopback)
    assert reaches(V4("0.0.0.0"), loopback) and reaches(V6("::"), loopback)
    assert reaches(V6("::ffff:127.0.0.1"), loopback)
    assert not reaches(V4("10.0.0.5"), loopback) and not reaches(V6("::1"), loopback)


def test_a_socket_no_visible_process_holds_is_named_as_another_users_process():
    (name,) = describe_holders({"socket:[1]": 0})  # inode 1 is no TCP socket: nothing here holds it
    assert name.startswith("another process (") and "uid 0" in name


def test_a_listener_held_inside_the_tree_is_ours_and_outside_it_is_named_by_pid():
    port = free_port()
    with socket.socket() as server:
        server.bind((LOOPBACK, port))
        server.listen()
        assert listener_owners(LOOPBACK, port, os.getpid()) == PortOwners(ours=1, others=())
        stranger = listener_owners(LOOPBACK, port, unused_pid())
        assert stranger is not None and stranger.ours == 0
        assert [name.split(" (")[0] for name in stranger.others] == [f"pid {os.getpid()}"]
        assert listener_owners("10.255.255.1", port, os.getpid()) == PortOwners(ours=0, others=())


def test_the_tree_of_a_process_holds_its_descendants():
    assert os.getpid() in process_tree(os.getppid())
    assert process_tree(unused_pid()) == {unused_pid()}
