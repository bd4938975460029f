"""A node agent (the Ray actor that starts a node's processes) loads none of the heavy packages its processes use."""

import subprocess
import sys


def test_the_executors_import_no_torch_transformers_or_peft():
    code = (
        "import sys; import miles_runner.executors.ray, miles_runner.executors.local; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
