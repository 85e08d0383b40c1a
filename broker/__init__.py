"""The broker: pool membership, placement and the service around them.

Pure cores (pool membership as `apply(state, event)`, placement, re-planning, queue policies)
and, around them, the service: registry, model store, job runner persisted in SQLite, HTTP API,
dashboard and metrics. The broker never executes model stages; providers do.
"""
