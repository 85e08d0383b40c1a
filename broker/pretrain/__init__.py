"""Train jobs: pre-training every weight of a decoder package with data-parallel replicas on
providers, their gradients all-reduced peer to peer.

`kind.py` (the submission: checks, corpus, graph; results), `run.py` (a job through the
providers: two-phase steps, replicas lost and joining, the broker restarting, the trained
model at the end).
"""

from broker.pretrain.kind import TrainJobs

__all__ = ["TrainJobs"]
