"""What a generation session's stages are replayed with, and why a provider's session is given
up on (`client.session`, `client.shadow`)."""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


class Mismatch(Exception):
    """The provider's session does not hold the context it should."""


class Lost(Exception):
    """The broker declared the provider lost while a request to it was out."""


def joined(history: list[dict[str, Array]]) -> dict[str, Array]:
    """A stage's past steps as one step (a replay)."""
    return {name: np.concatenate([h[name] for h in history], axis=1) for name in history[0]}
