"""Multi-LoRA (docs/system.md §4): many adapters trained at once on shared engines.

Control plane: `config` (what an adapter run is, and the checks at registration), `registry` (the lifecycle
state machine), `controller` (the registry plus aborts on the engines), `http_server` and `client` (the API
and the driver's handle on a controller in another process), `cache` (short-TTL snapshots for the hot path).
Rollout side: `buffers` (per-adapter group buffers and round-robin selection), `collect` (train batches),
`producer` (groups generated for every live adapter, independent of the trainer).
"""
