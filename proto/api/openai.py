"""OpenAI's shapes for `/v1/embeddings` and `/v1/completions`: what the `openai` Python
package sends and reads. Fields the swarm does not implement (`logprobs`, `echo`, penalties,
`n` > 1, ...) are accepted only with their neutral value (the broker refuses others, naming
the field), rather than silently ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from proto.api.common import ModelName
from proto.api.swarm import Verdict

MAX_INPUTS = 2048  # texts in one embeddings request, as OpenAI allows
MAX_PROMPTS = 16  # prompts in one completions request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_TEXT_CHARS = 1_000_000  # one input text or message; longer ones are refused (400)
MAX_STOP_CHARS = 1000  # one stop string

_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]

_Id = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Input = Annotated[
    _Text | Annotated[list[_Text | _Id | list[_Id]], msgspec.Meta(max_length=1_000_000)],
    msgspec.Meta(
        title="Input",
        description="a string, strings, token ids, or lists of token ids (not mixed)",
        extra_json_schema={
            "oneOf": [
                {"type": "string", "maxLength": MAX_TEXT_CHARS},
                {"type": "array", "items": {"type": "string", "maxLength": MAX_TEXT_CHARS}},
                {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
                },
            ]
        },
    ),
]  # (msgspec allows one list type per union: the broker checks the forms do not mix)
Stop = Annotated[
    Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]
    | Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]], msgspec.Meta(max_length=4)
    ]
    | None,
    msgspec.Meta(description="a string or up to 4 strings that end the text"),
]


class EmbeddingRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelName
    input: Input
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: (
        Annotated[int, msgspec.Meta(ge=1, description="must equal the model's size")] | None
    ) = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None


class Embedding(msgspec.Struct, frozen=True):
    index: int
    embedding: Annotated[
        list[float] | str,
        msgspec.Meta(description="floats, or base64 of little-endian float32"),
    ]
    object: Literal["embedding"] = "embedding"


class EmbeddingList(msgspec.Struct, frozen=True):
    data: list[Embedding]
    model: str
    usage: Usage
    object: Literal["list"] = "list"


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_route: Annotated[
        bool,
        msgspec.Meta(
            description="not OpenAI's: each chunk with text also says which providers ran the "
            "token's stages and how long the token took (`fusionai`)"
        ),
    ] = False


class TokenRoute(msgspec.Struct, frozen=True):
    """Who made a token: the provider of each stage, in order, and the milliseconds from the
    token before (the dashboard's playground shows them)."""

    providers: list[str]
    ms: float


class Verification(msgspec.Struct, frozen=True):
    """The broker's check of one answer (choice `index`): its run of the model over the
    answer's tokens against what each provider signed it computed (`verdict.ok` false: a
    provider's work was not reproduced, and it is quarantined; the text was delivered already).
    Sent for a sampled share of answers (the gateway's `--verify-share`)."""

    index: int
    verdict: Verdict


class CompletionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelName
    prompt: Input
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None  # 16 when absent
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None  # 1
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # 1
    n: Annotated[int, msgspec.Meta(description="only 1")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    echo: Annotated[bool, msgspec.Meta(description="only false")] | None = None
    logprobs: Annotated[int, msgspec.Meta(description="not supported: null only")] | None = None
    best_of: Annotated[int, msgspec.Meta(description="only 1")] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(description="only 0")] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(description="only 0")] | None = None
    logit_bias: (
        Annotated[
            dict[str, float], msgspec.Meta(max_length=0, description="not supported: empty only")
        ]
        | None
    ) = None
    suffix: Annotated[str, msgspec.Meta(description="not supported: null only")] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class Choice(msgspec.Struct, frozen=True):
    text: str
    index: int
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class Completion(msgspec.Struct, frozen=True):
    """A completion; each chunk of a stream has this shape too (one choice, or none and the
    usage when `stream_options.include_usage` asked for it; other chunks have no usage)."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    object: Literal["text_completion"] = "text_completion"
    fusionai: TokenRoute | msgspec.UnsetType = msgspec.UNSET  # `include_route` asked for it
    # checked answers (a stream: on the answer's chunk with its finish reason)
    verification: list[Verification] | msgspec.UnsetType = msgspec.UNSET


# ---- chat completions ----------------------------------------------------------------------

MAX_MESSAGES = 1024  # messages in one chat request


class TextPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="text"):
    """A text part of a message's content (`{"type": "text", "text": ...}`); other part types
    (images, audio, files) are refused."""

    text: _Text


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _Text | Annotated[list[TextPart], msgspec.Meta(max_length=1024)] | None = None
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # what the openai package sends back with an earlier answer: accepted empty only
    tool_calls: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=0)] | None = None
    tool_call_id: Annotated[str, msgspec.Meta(description="not supported: null only")] | None = None
    function_call: None = None
    refusal: None = None
    audio: None = None
    annotations: Annotated[list[Any], msgspec.Meta(max_length=0)] | None = None


class ResponseFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Annotated[Literal["text"], msgspec.Meta(description="only text")]


class ChatCompletionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: ModelName
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None  # 1
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # 1
    n: Annotated[int, msgspec.Meta(description="only 1")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(description="only 0")] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(description="only 0")] | None = None
    logprobs: Annotated[bool, msgspec.Meta(description="only false")] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(description="not supported: null only")] | None = None
    logit_bias: (
        Annotated[
            dict[str, float], msgspec.Meta(max_length=0, description="not supported: empty only")
        ]
        | None
    ) = None
    tools: (
        Annotated[list[dict[str, Any]], msgspec.Meta(max_length=0, description="empty only")] | None
    ) = None
    tool_choice: Annotated[str, msgspec.Meta(description="only none")] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class AssistantMessage(msgspec.Struct, frozen=True):
    content: str
    role: Literal["assistant"] = "assistant"
    refusal: None = None


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    verification: list[Verification] | msgspec.UnsetType = msgspec.UNSET  # checked answers


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True):
    """One event of a streamed chat completion: the first carries the role, then text, then
    one with the finish reason; with `stream_options.include_usage`, a last one with no
    choices and the usage."""

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    fusionai: TokenRoute | msgspec.UnsetType = msgspec.UNSET  # `include_route` asked for it
    verification: list[Verification] | msgspec.UnsetType = msgspec.UNSET  # (as `Completion`)
