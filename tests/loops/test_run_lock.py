"""One driver per run folder: a second one waits for the first to go, and names it if it does not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from miles_runner.core.run_lock import RunFolderBusy, hold_run_folder

HOLDER = """
import sys, time
from pathlib import Path
from miles_runner.core.run_lock import hold_run_folder
with hold_run_folder(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def start_holder(run_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_driver_is_refused_naming_the_live_one(tmp_path):
    holder = start_holder(tmp_path)
    try:
        busy = rf"in use by another driver \(pid {holder.pid}\).*own run.dir"
        with pytest.raises(RunFolderBusy, match=busy), hold_run_folder(tmp_path, wait_s=0.5):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_driver_lets_the_waiting_one_in_with_no_stale_lock(tmp_path):
    holder = start_holder(tmp_path)
    threading.Timer(0.5, holder.send_signal, (signal.SIGKILL,)).start()
    started = time.monotonic()
    with hold_run_folder(tmp_path, wait_s=30):
        waited = time.monotonic() - started
        assert (tmp_path / ".driver.lock").read_text().strip() == str(os.getpid())
    holder.wait()
    assert 0.4 < waited < 30
    with hold_run_folder(tmp_path, wait_s=0):  # released on exit: the next driver gets it at once
        pass
