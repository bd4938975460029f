"""Runtime: supervision of the processes the runner starts (engines, router, servers) and executors."""
