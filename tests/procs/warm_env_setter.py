"""Preloaded by the warm start server of tests/procs/test_warm.py: a library that reads a variable at import and sets
it when unset (as torch does TORCHINDUCTOR_CACHE_DIR)."""

import os

os.environ.setdefault("MILES_PROBE_IMPORT_SET", "computed-at-import")
