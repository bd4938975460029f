"""`python -m miles_runner.cli ...` is `miles-run ...`."""

import sys

from miles_runner.cli.main import main

sys.exit(main())
