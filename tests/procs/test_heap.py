"""freeze_startup_heap (miles_runner/procs/heap.py): start-up garbage is collected, not frozen; what is alive is
frozen out of later collections, and what the component allocates afterwards is collected as before. Run in a
child interpreter: freezing the test process's own heap would change its collections for the tests after."""

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc, json, weakref
    from miles_runner.procs.heap import freeze_startup_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    kept = [Node() for _ in range(1000)]  # alive at start-up: the imported libraries, the model
    startup_garbage = cycle()  # unreachable already, but only a collection frees a cycle
    freeze_startup_heap()
    frozen = gc.get_freeze_count()
    later_garbage = cycle()
    gc.collect()
    print(json.dumps({"frozen": frozen, "kept_frozen": frozen >= len(kept),
                      "startup_garbage_freed": startup_garbage() is None,
                      "later_garbage_freed": later_garbage() is None, "enabled": gc.isenabled()}))
""")


def test_start_up_garbage_is_freed_what_lives_is_frozen_and_later_garbage_is_still_collected():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["kept_frozen"] and seen["startup_garbage_freed"], seen
    assert seen["later_garbage_freed"] and seen["enabled"], seen
