"""Chat templates: a model's own Jinja template turning messages into its prompt text.

A template comes with the model (its tokenizer files or GGUF metadata) and is code written by
whoever published the model, so it runs in Jinja's immutable sandbox, set up as transformers
sets it up (`apply_chat_template`): `trim_blocks` and `lstrip_blocks`, loop controls, the
`{% generation %}` tag, `raise_exception`, `strftime_now`, `namespace`, a `tojson` that keeps
non-ASCII text, and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as
variables. The same template and messages give the same text here and in transformers.

Before a template is used it is checked whole (`check_template`): one that reads underscore
attributes (`__class__`, ...), includes or imports other templates (file reads), or does not
parse is refused with the reason, and nothing of it runs. The sandbox stays the guard for
what only shows at run time, with bounds of our own: the rendered text (`MAX_PROMPT_CHARS`),
strings and lists made by `*` and numbers by `**`, and the time a render takes
(`MAX_RENDER_S`, checked at each call the template makes and each piece it writes: a loop
of loops calls `range` for each inner loop).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ir.errors import IRError

MAX_TEMPLATE_CHARS = 256 * 1024
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_RENDER_S = 2.0  # a render's time, checked at every call the template makes
# transformers' named special tokens, given to the template as variables
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


_limits = threading.local()  # this thread's render deadline


class ChatError(IRError):
    """A chat template that cannot be used, or messages it cannot render; says why."""


@dataclass(frozen=True)
class Chat:
    """What a package needs to chat: the template, the special tokens it may name, and every
    token id that ends a turn (generation stops at any of them)."""

    template: str | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    stop_token_ids: Sequence[int] = ()


def check_template(source: str) -> None:
    """Refuse a template that does not parse, reads underscore attributes, or reaches other
    templates or files; it is not run."""
    _compiled(source)


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    special_tokens: Mapping[str, str] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of `messages` (plain JSON data: dicts of strings, lists, numbers)."""
    import jinja2

    template = _compiled(source)
    names = {k: str(v) for k, v in (special_tokens or {}).items() if k in SPECIAL_TOKENS}
    _limits.deadline = time.monotonic() + MAX_RENDER_S
    try:
        pieces, size = [], 0
        for piece in template.generate(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **names,
        ):
            size += len(piece)
            _check_time()
            if size > MAX_PROMPT_CHARS:
                raise ChatError(
                    f"the chat template renders more than {MAX_PROMPT_CHARS} characters"
                )
            pieces.append(piece)
    except jinja2.exceptions.SecurityError as exc:
        raise ChatError(f"the chat template did something the sandbox forbids: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:  # raise_exception(...) in the template
        raise ChatError(f"the chat template refused these messages: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise ChatError(f"the chat template failed on these messages: {exc}") from None
    return "".join(pieces)


@functools.lru_cache(maxsize=32)
def _compiled(source: str) -> Any:
    import jinja2
    from jinja2 import nodes

    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatError(
            f"the chat template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS}"
        )
    env = _environment()
    try:
        tree = env.parse(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatError(
            f"the chat template does not parse (line {exc.lineno}): {exc.message}"
        ) from None
    verbs = {nodes.Include: "includes", nodes.Import: "imports", nodes.FromImport: "imports"}
    for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
        raise ChatError(
            f"the chat template {verbs.get(type(node), 'extends')} another template (line "
            f"{node.lineno}): a template may not read files"
        )
    for attr in tree.find_all(nodes.Getattr):
        if attr.attr.startswith("_"):
            raise ChatError(
                f"the chat template reads the attribute {attr.attr!r} (line {attr.lineno}): "
                "underscore attributes are refused"
            )
    for item in tree.find_all(nodes.Getitem):
        if isinstance(item.arg, nodes.Const) and str(item.arg.value).startswith("_"):
            raise ChatError(
                f"the chat template reads the item {item.arg.value!r} (line {item.lineno}): "
                "underscore attributes are refused"
            )
    for call in tree.find_all(nodes.Filter):
        if call.name == "attr" and any(
            isinstance(a, nodes.Const) and str(a.value).startswith("_") for a in call.args
        ):
            raise ChatError(
                f"the chat template reads an underscore attribute through `attr` (line "
                f"{call.lineno}): refused"
            )
    return env.from_string(tree)


def _check_time() -> None:
    import jinja2

    if time.monotonic() > getattr(_limits, "deadline", float("inf")):
        raise jinja2.exceptions.SecurityError(f"the render took longer than {MAX_RENDER_S:g} s")


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's part; rendered as is."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 reads a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _no_underscore(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _no_underscore(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _no_underscore(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace may not hold {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with bounds on time, on `*` and on `**`."""

        intercepted_binops = frozenset({"*", "**"})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _check_time()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                if isinstance(right, int | float) and abs(right) > 64:
                    raise jinja2.exceptions.SecurityError("an exponent above 64 is refused")
                return left**right
            for seq, n in ((left, right), (right, left)):
                big = isinstance(seq, str | list | tuple) and isinstance(n, int)
                if big and len(seq) * n > MAX_PROMPT_CHARS:
                    raise jinja2.exceptions.SecurityError(
                        f"`*` would make {len(seq) * n} items; at most {MAX_PROMPT_CHARS}"
                    )
            return left * right

    env = Bounded(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=Dict(),
        namespace=Namespace,
    )
    return env


def from_folder(path: Path) -> Chat:
    """A transformers model folder's chat template (`chat_template.jinja`, `chat_template.json`
    or `tokenizer_config.json`), named special tokens, and end-of-turn ids
    (`generation_config.json`'s `eos_token_id`, then `config.json`'s)."""
    config = _json(path / "tokenizer_config.json")
    template: Any = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        template = _json(path / "chat_template.json").get("chat_template") or config.get(
            "chat_template"
        )
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatError(f"{path}: the chat template is not a string")
    special: dict[str, str] = {}
    for source in (_json(path / "special_tokens_map.json"), config):
        for name in SPECIAL_TOKENS:
            value = source.get(name)
            if isinstance(value, dict):  # an AddedToken written out
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
    stops: list[int] = []
    for source in (_json(path / "generation_config.json"), _json(path / "config.json")):
        ids = source.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in stops:
                stops.append(i)
    if template is not None:
        check_template(template)
    return Chat(template, special, tuple(stops))


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ChatError(f"{path} is not valid JSON: {exc}") from None
    return value if isinstance(value, dict) else {}
