"""ML procedures as DAGs (networkx): builders, validation and the cost model.

Owns the task graphs of inference pipelines, generation loops, fine-tuning and data-parallel
training, their validation and wire form, and the cost model that turns hardware profiles into
task and transfer times. Pure functions: no I/O.
"""
