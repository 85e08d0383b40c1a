"""Training data and adapters on the user's side: texts read from files (one per line, or
JSON lines), a fine-tune job's adapter file checked against the model it is applied to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from client.errors import (
    FusionAIError,
)

Array = np.ndarray[Any, Any]


SAMPLE_DATA = Path(__file__).parent / "data" / "swarm-notes.jsonl"  # 40 sentences, shipped


def read_texts(path: str | Path) -> list[str]:
    """Training texts from a file: JSONL with a "text" field per line (`.jsonl`), else one
    example per non-empty line."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text") from None
    texts: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if file.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{file}:{n}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f'{file}:{n}: each line is an object with a "text" string')
            texts.append(row["text"])
        else:
            texts.append(line)
    if not texts:
        raise ValueError(f"{file} has no examples")
    return texts


def load_adapter(path: Path, model: str) -> dict[str, Array]:
    """A safetensors adapter's tensors; refused if it was trained for another model."""
    from ir.training import TrainingError, load_state, read_metadata

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FusionAIError(f"cannot read adapter {path}: {exc.strerror}") from None
    try:
        meta = read_metadata(data)
        tensors = load_state(data)
    except TrainingError as exc:
        raise FusionAIError(f"{path}: {exc}") from None
    if meta.get("model") not in (None, model):
        raise FusionAIError(f"{path} is an adapter for {meta['model']}, not {model}")
    if not tensors or not all(k.startswith("lora_") for k in tensors):
        raise FusionAIError(f"{path} holds no LoRA adapter tensors (lora_A.*, lora_B.*)")
    return tensors
