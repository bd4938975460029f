"""Plan: compile a validated config into the frozen Plan that the executors run."""
