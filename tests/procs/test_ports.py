"""Free ports: picked where no outgoing connection can take them meanwhile, never twice by one process, and never
one a server already listens on."""

import os
import socket
import subprocess
import sys

import pytest

from miles_runner.procs import ports
from miles_runner.procs.ports import (
    LOOPBACK,
    free_port,
    free_port_block,
    free_ports,
    listen_port_range,
    port_holders,
)


def ephemeral_range() -> range:
    low, high = map(int, ports.EPHEMERAL_RANGE.read_text().split())
    return range(low, high + 1)


def test_picked_ports_lie_below_the_kernels_ephemeral_range_where_clients_get_their_local_ports():
    picked = free_ports(50)
    assert not set(picked) & set(ephemeral_range())
    assert all(port in listen_port_range() for port in picked)


def test_picked_ports_lie_outside_rays_default_worker_ports_which_ray_refuses_its_own_ports_in():
    from ray.scripts.scripts import start  # `ray start`'s own defaults, as the job script and the tests start Ray

    defaults = {param.name: param.default for param in start.params}
    workers = range(defaults["min_worker_port"], defaults["max_worker_port"] + 1)
    assert not set(listen_port_range()) & set(workers)


def test_one_process_never_hands_out_the_same_port_twice():
    picked = [free_port() for _ in range(300)]
    base = free_port_block(4)
    assert len(set(picked)) == len(picked)
    assert not {base + i for i in range(4)} & set(picked)


def test_a_port_a_server_listens_on_is_never_picked(monkeypatch):
    taken = free_port_block(3)  # the listener's port and two free ones after it
    with socket.socket() as server:
        server.bind((LOOPBACK, taken))
        server.listen()
        monkeypatch.setattr(ports, "listen_port_range", lambda: range(taken, taken + 3))
        monkeypatch.setattr(ports, "_handed_out", set())
        assert sorted(free_port() for _ in range(2)) == [taken + 1, taken + 2]
        with pytest.raises(RuntimeError, match="no block of 1 free"):
            free_port()  # the listener's port is all that is left


def test_a_block_is_consecutive_and_every_port_of_it_is_free():
    base = free_port_block(3)
    for port in range(base, base + 3):
        with socket.socket() as server:
            server.bind((LOOPBACK, port))  # would raise if taken


def test_the_job_scripts_port_command_prints_distinct_ports_for_every_interface():
    done = subprocess.run(
        [sys.executable, "-m", "miles_runner.slurm.free_ports", "3"], capture_output=True, text=True, check=True
    )
    printed = [int(port) for port in done.stdout.split()]
    assert len(set(printed)) == 3
    for port in printed:
        with socket.socket() as server:
            server.bind(("0.0.0.0", port))


def test_ports_to_avoid_are_never_picked(monkeypatch):
    base = free_port_block(3)
    monkeypatch.setattr(ports, "listen_port_range", lambda: range(base, base + 3))
    monkeypatch.setattr(ports, "_handed_out", set())
    assert sorted(free_ports(2, avoid={base + 1})) == [base, base + 2]
    with pytest.raises(RuntimeError, match="no block of 1 free"):
        free_ports(1, avoid={base + 1})  # the rest of the range was handed out above


def test_the_holder_of_a_port_is_named_by_pid_and_command_line():
    port = free_port()
    with socket.socket() as server:
        server.bind((LOOPBACK, port))
        server.listen()
        assert f"pid {os.getpid()} (" in " ".join(port_holders(port))
    assert port_holders(port) == []  # closed: no socket holds it any more
