"""Chat templates: rendered as transformers renders them, refused before they run when they
reach for what the sandbox forbids, read from transformers folders and GGUF files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ir.chat import ChatError, check_template, from_folder, render
from tests.procs import ROOT
from tests.tiny_models import CHATML, chat_tokenizer

pytestmark = pytest.mark.timeout(120)

# Templates written for these tests, each leaning on a feature of transformers' environment.
TEMPLATES = {
    "chatml": CHATML,
    # trim_blocks and lstrip_blocks decide this one's whitespace; loop.first, filters
    "plain": """{% for message in messages %}
{% if loop.first and message.role != 'system' %}
<s>
{% endif %}
  [{{ message.role | upper }}] {{ message.content }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}""",
    # bos_token, strftime_now, loop controls, tojson keeping non-ASCII, dict(), generation
    "tools": """{{- bos_token or '' -}}
{%- if strftime_now is defined %}{{ strftime_now('%Y') | length }}{% endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- if loop.index > 6 %}{% break %}{% endif -%}
  {{- (dict(role=m.role, text=m.content) | tojson) + '\\n' -}}
  {%- if m.role == 'assistant' -%}{% generation %}{{ m.content }}{% endgeneration %}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ eos_token }}>{% endif -%}""",
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello world!"}],
    [
        {"role": "system", "content": "You run on gaming PCs."},
        {"role": "user", "content": "  What is a broker?  "},
        {"role": "assistant", "content": "It keeps a pool of providers: “ünïcode” 🚀"},
        {"role": "user", "content": "And a backup?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return chat_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_renders_them(tokenizer: Any, name: str) -> None:
    template = TEMPLATES[name]
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            want = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=prompt
            )
            got = render(
                template, messages, tokenizer.special_tokens_map, add_generation_prompt=prompt
            )
            assert got == want, (name, prompt)


def test_a_template_refusing_messages_says_so(tokenizer: Any) -> None:
    with pytest.raises(ChatError, match="refused these messages: roles are system, user and"):
        render(CHATML, [{"role": "tool", "content": "x"}], tokenizer.special_tokens_map)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "reads the attribute '__subclasses__'"),
        ("{{ messages | attr('__class__') }}", "underscore attribute through `attr`"),
        ("{{ messages['__class__'] }}", "reads the item '__class__'"),
        ("{% include '/etc/passwd' %}", "includes another template .*may not read files"),
        ("{% import 'os' as os %}", "imports another template"),
        ("{% extends 'base.html' %}", "extends another template"),
        ("{% for m in messages %}{{ m }", "does not parse"),
        ("x" * (256 * 1024 + 1), "at most"),
    ],
)
def test_templates_reaching_out_of_the_sandbox_are_refused_unrun(template: str, match: str) -> None:
    with pytest.raises(ChatError, match=match):
        check_template(template)
    with pytest.raises(ChatError, match=match):
        render(template, [{"role": "user", "content": "hi"}])


def test_the_sandbox_stops_what_shows_only_at_run_time() -> None:
    with pytest.raises(ChatError, match="sandbox forbids"):
        render("{{ messages.append(1) }}", [{"role": "user", "content": "hi"}])
    name = "{% set n = '__cla' ~ 'ss__' %}[{{ messages[n] }}]"  # computed: not seen unrun
    assert render(name, [{"role": "user", "content": "hi"}]) == "[]"  # the sandbox's blank
    with pytest.raises(ChatError, match="more than"):
        render("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", [])
    with pytest.raises(ChatError, match="would make 10000000000 items"):
        render("{{ 'x' * 10000000000 }}", [])
    with pytest.raises(ChatError, match="exponent above 64"):
        render("{{ 2 ** 100000000 }}", [])
    started = time.monotonic()
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatError, match="longer than 2 s"):
        render(loops, [])  # 10^10 silent iterations: stopped at the deadline
    assert time.monotonic() - started < 4


def test_a_folder_gives_its_template_special_tokens_and_every_end_of_turn_id(
    tokenizer: Any, tmp_path: Path
) -> None:
    chat_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9, "bos_token_id": 1}))
    chat = from_folder(tmp_path)
    assert chat.template == CHATML and chat.stop_token_ids == (7, 9)
    assert chat.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    # older folders keep the template in tokenizer_config.json, sometimes as named templates
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": "y"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert from_folder(tmp_path).template == "y"


def test_ir_split_refuses_a_folder_whose_template_escapes_before_writing(tmp_path: Path) -> None:
    chat_tokenizer(tmp_path / "model", "{{ cycler.__init__.__globals__.os.popen('id').read() }}")
    (tmp_path / "model" / "config.json").write_text("{}")
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "ir", "split", str(tmp_path / "model"), "--out",
         str(tmp_path / "pkg")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "reads the attribute '__globals__'" in done.stderr, done.stderr
    assert not (tmp_path / "pkg").exists()


def test_a_package_whose_manifest_carries_an_escaping_template_is_refused(
    llama_package: Path, tmp_path: Path
) -> None:
    """What a broker or provider loads is checked too (a manifest edited after the split)."""
    import shutil

    from ir.package import load_package

    shutil.copytree(llama_package, tmp_path / "pkg")
    doc = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    doc["chat_template"] = "{{ lipsum.__globals__ }}"
    (tmp_path / "pkg" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ChatError, match="'__globals__'"):
        load_package(tmp_path / "pkg")
