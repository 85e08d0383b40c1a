"""Discrete-event simulation of swarms on a virtual clock.

Owns the event engine, GPU and network catalogs, churn models, workloads, reports and plots.
Scheduling comes from `broker`'s pure cores and costs from `dag`'s cost model: no second copy.
"""
