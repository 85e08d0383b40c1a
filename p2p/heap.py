"""A serving process's heap, kept out of its tokens' way.

CPython's cyclic garbage collector now and then runs a full collection, which walks every
container object the process holds. A daemon that has imported onnxruntime, numpy, libp2p and
the rest holds a great many, nearly all alive for good: in the lab, one such collection in a
provider took 80 to 100 ms of CPU, over 0.35 s at a quarter of a core, and every session through
that provider waited for it, two or three times in a 24-token generation.

`settle()` collects once, then moves what survives into the permanent generation
(`gc.freeze`), which later collections skip: a full collection then walks only what was made
since. Long-lived daemons call it once they are up (the provider, the broker) and again after
each stage they load (the provider). Each call first unfreezes, so garbage left among the
frozen objects (a dropped stage's) is collected then, not leaked for good. A library (the
SDK inside a user's program) leaves its host process's collector alone.
"""

from __future__ import annotations

import gc
import time


def settle() -> float:
    """Collect the cyclic garbage, then freeze what is left; the seconds it took."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - started
