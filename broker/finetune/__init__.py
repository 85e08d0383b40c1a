"""Fine-tune jobs: LoRA-FA (or LoRA) training of a decoder through the swarm's stages.

`request.py` (the submission, its graph and data), `step.py` (one optimizer step through the
one graph executor; `LocalFinetune`, the one-process reference), `swarm.py` (a job through
the providers: snapshots, recovery), `kind.py` (the job kind the runner calls).
"""

from broker.finetune.request import FinetuneRequest, parse_finetune
from broker.finetune.step import LocalFinetune

__all__ = ["FinetuneRequest", "LocalFinetune", "parse_finetune"]
