"""Host memory as a process sees it: give freed pages back, and read what is resident (what offload figures
measure)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path


def return_freed_pages() -> None:
    """Hand freed heap pages back to the OS: glibc keeps freed chunks below its mmap threshold (which rises as large
    blocks are freed), so the resident memory would not drop by what was freed."""
    gc.collect()
    if libc_name := ctypes.util.find_library("c"):
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
