"""Session server for agentic rollouts: TITO state, records, sample assembly and incremental R3."""
