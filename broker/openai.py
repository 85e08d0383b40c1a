"""OpenAI's request shapes for `/v1/embeddings` and `/v1/completions`, checked: what the
`openai` Python package sends. Fields the swarm does not implement (`logprobs`, `echo`,
penalties, `n` > 1, ...) are refused naming the field, rather than silently ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.jobkinds import JobError

MAX_INPUTS = 2048  # texts in one embeddings request, as OpenAI allows
MAX_PROMPTS = 16  # prompts in one completions request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def parse_input(value: Any, field: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's input forms: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str) or _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise JobError(field, "give a string, a list of strings, or token ids")
    if len(value) > MAX_INPUTS:
        raise JobError(field, f"{len(value)} inputs; at most {MAX_INPUTS} per request")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise JobError(field, "an input is the empty string")
        return value, None
    if all(_is_ids(v) for v in value):
        return None, value
    raise JobError(field, "mixes strings and token ids, or holds an empty list")


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise JobError(name, f"must be a number from {low:g} to {high:g}")
    return float(value)


def _require(body: dict[str, Any], name: str, ok: Any, why: str) -> None:
    """Refuse a field the swarm does not implement unless it has its neutral value."""
    if name in body and body[name] is not None and body[name] != ok:
        raise JobError(name, why)


def model_of(body: Any) -> str:
    if not isinstance(body, dict):
        raise JobError("body", "the request is a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise JobError("model", "name the model (a string)")
    return model


EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
COMPLETION_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "echo",
    "logprobs",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "suffix",
    "user",
}


def refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise JobError(extra[0], "unrecognized request argument")


@dataclass(frozen=True)
class Completion:
    model: str
    prompts: list[str] | None
    prompt_ids: list[list[int]] | None
    max_tokens: int
    temperature: float
    top_p: float
    stream: bool
    include_usage: bool
    stop: list[str]
    seed: int | None


def parse_completion(body: Any) -> Completion:
    model = model_of(body)
    refuse_unknown(body, COMPLETION_FIELDS)
    prompts, ids = parse_input(body.get("prompt"), "prompt")
    if len(prompts or ids or []) > MAX_PROMPTS:
        raise JobError("prompt", f"at most {MAX_PROMPTS} prompts per request")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if type(max_tokens) is not int or not 1 <= max_tokens <= 4096:
        raise JobError("max_tokens", "must be an integer from 1 to 4096")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise JobError("stream", "must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
        raise JobError("stream_options", 'only {"include_usage": bool} is supported')
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise JobError("stop", "a string or a list of up to 4 strings")
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise JobError("seed", "must be a non-negative integer")
    _require(body, "n", 1, "only n=1 is supported")
    _require(body, "best_of", 1, "only best_of=1 is supported")
    _require(body, "echo", False, "echo is not supported")
    _require(body, "logprobs", None, "logprobs are not supported")
    _require(body, "suffix", None, "suffix is not supported")
    _require(body, "presence_penalty", 0, "penalties are not supported")
    _require(body, "frequency_penalty", 0, "penalties are not supported")
    if body.get("logit_bias"):
        raise JobError("logit_bias", "logit_bias is not supported")
    if "user" in body and not isinstance(body["user"], str | type(None)):
        raise JobError("user", "must be a string")
    return Completion(
        model=model,
        prompts=prompts,
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        stream=bool(stream),
        include_usage=bool(options.get("include_usage", False)),
        stop=stop,
        seed=seed,
    )
