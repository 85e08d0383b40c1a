"""GGUF input for `fusionai ir split`: the files llama.cpp, Ollama and LM Studio users have."""

from __future__ import annotations

from ir.gguf.reader import GGUFError, GGUFModel, shard_files

__all__ = ["GGUFError", "GGUFModel", "shard_files"]
