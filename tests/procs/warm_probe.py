"""`python -m tests.procs.warm_probe OUT CODE`: writes what this process sees of its start to OUT (JSON), prints a
line to its log, then exits with CODE, or with CODE "wait" waits for a signal (tests/procs/test_warm.py)."""

import gc
import json
import logging
import os
import signal
import sys
import threading
import time

import numpy as np

import tests.procs.warm_env_setter  # noqa: F401 - what the server preloads, a cold start imports itself


def seen() -> dict:
    devnull, stdin = os.stat(os.devnull), os.fstat(0)
    return {
        "name": __name__,
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "own_group": os.getpgid(0) == os.getpid(),
        "own_session": os.getsid(0) == os.getpid(),
        "stdin_is_devnull": (stdin.st_dev, stdin.st_ino) == (devnull.st_dev, devnull.st_ino),
        "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
        "threads": threading.active_count(),
        "root_logging": [logging.root.level, len(logging.root.handlers)],  # not the server's basicConfig
        "numpy_draw": float(np.random.random()),
        "gc_enabled": gc.isenabled(),
        "frozen_objects": gc.get_freeze_count(),  # what this process's full collections skip
        "main_has_only_its_own_names": "WarmServer" not in sys.modules["__main__"].__dict__,
    }


if __name__ == "__main__":
    out, code = sys.argv[1], sys.argv[2]
    with open(out, "w") as f:
        json.dump(seen(), f)
    print(f"probe {os.getpid()} wrote {out}", flush=True)
    if code == "wait":
        while True:
            time.sleep(1)
    sys.exit(int(code))
