"""Tensor-parallel worker groups on Ray: one engine replica = one group of ranks.

    messages.py  the per-step message (deltas), the block-table mirrors on both sides, the draws back
    sampling.py  the sampling rank's per-sequence records and draws (the engine's own sampler)
    weights.py   rank 0 reads the checkpoint once and scatters each rank its shard
    rank.py      the rank actor: its model shard, KV-cache shard, one step at a time
    group.py     placement group, start-up handshake with timeouts, health, teardown
    executor.py  WorkerGroupExecutor, the engine's Executor for tensor_parallel_size > 1
    server.py    EngineServer, the Serve deployment of one engine replica (one group)
    metrics.py   the replica's Prometheus metrics; autoscale_stats.py, what it tells Serve's autoscaler
"""
