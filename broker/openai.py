"""OpenAI's requests for `/v1/embeddings`, `/v1/completions` and `/v1/chat/completions`,
checked beyond their shape
(`proto.api.openai`): the input forms do not mix, and fields the swarm does not implement
(`logprobs`, `echo`, penalties, `n` > 1, ...) are refused naming the field unless they have
their neutral value, rather than silently ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.jobkinds import JobError
from proto.api.openai import (
    DEFAULT_MAX_TOKENS,
    MAX_INPUTS,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
)


def parse_input(value: Any, field: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's input forms: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str) or (value and all(type(t) is int for t in value)):
        value = [value]
    if not value:
        raise JobError(field, "give a string, a list of strings, or token ids")
    if len(value) > MAX_INPUTS:
        raise JobError(field, f"{len(value)} inputs; at most {MAX_INPUTS} per request")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise JobError(field, "an input is the empty string")
        return value, None
    if all(isinstance(v, list) and v for v in value):
        return None, value
    raise JobError(field, "mixes strings and token ids, or holds an empty list")


@dataclass(frozen=True)
class Completion:
    model: str
    prompts: list[str] | None
    prompt_ids: list[list[int]] | None
    max_tokens: int  # 0: until the model's context is full (chat's default)
    temperature: float
    top_p: float
    stream: bool
    include_usage: bool
    include_route: bool  # chunks say who ran each token's stages (`oa.TokenRoute`)
    stop: list[str]
    seed: int | None


NEUTRAL = {  # fields accepted only with their neutral value, and why
    "n": (1, "only n=1 is supported"),
    "best_of": (1, "only best_of=1 is supported"),
    "echo": (False, "echo is not supported"),
    "presence_penalty": (0, "penalties are not supported"),
    "frequency_penalty": (0, "penalties are not supported"),
}


def parse_completion(body: CompletionRequest) -> Completion:
    prompts, ids = parse_input(body.prompt, "prompt")
    if len(prompts or ids or []) > MAX_PROMPTS:
        raise JobError("prompt", f"at most {MAX_PROMPTS} prompts per request")
    for name, (neutral, why) in NEUTRAL.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise JobError(name, why)
    if body.logprobs is not None:
        raise JobError("logprobs", "logprobs are not supported")
    if body.suffix is not None:
        raise JobError("suffix", "suffix is not supported")
    if body.logit_bias:
        raise JobError("logit_bias", "logit_bias is not supported")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    return Completion(
        model=body.model,
        prompts=prompts,
        prompt_ids=ids,
        max_tokens=body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        include_route=bool(body.stream_options and body.stream_options.include_route),
        stop=stop,
        seed=body.seed,
    )


def parse_chat(body: ChatCompletionRequest) -> tuple[Completion, list[dict[str, str]]]:
    """The completion's options and the messages as the chat template reads them (text
    parts joined by newlines; `developer` read as `system`)."""
    for name, (neutral, why) in NEUTRAL.items():
        value = getattr(body, name, None)
        if value is not None and value != neutral:
            raise JobError(name, why)
    if body.logprobs or body.top_logprobs is not None:
        raise JobError(
            "logprobs" if body.logprobs else "top_logprobs", "logprobs are not supported"
        )
    if body.tool_choice not in (None, "none"):
        raise JobError("tool_choice", 'tools are not supported: only "none"')
    if (
        body.max_tokens
        and body.max_completion_tokens
        and body.max_tokens != body.max_completion_tokens
    ):
        raise JobError("max_completion_tokens", "differs from max_tokens: give one")
    messages = []
    for i, m in enumerate(body.messages):
        if m.role == "tool" or m.tool_call_id is not None:
            raise JobError(f"messages[{i}]", "tool messages are not supported: no tools are called")
        if m.content is None:
            raise JobError(f"messages[{i}].content", "a message needs content")
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    completion = Completion(
        model=body.model,
        prompts=None,
        prompt_ids=None,
        max_tokens=body.max_completion_tokens or body.max_tokens or 0,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        include_route=bool(body.stream_options and body.stream_options.include_route),
        stop=stop,
        seed=body.seed,
    )
    return completion, messages
