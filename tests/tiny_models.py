"""Small random models shared by the test packages (built with a fixed seed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_llama() -> Any:
    """A 4-block Llama (hidden 128, grouped-query attention) with random weights."""
    import torch
    import transformers

    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


CORPUS = [
    "The swarm runs each stage on a gaming PC and sends hidden states to the next one.",
    "A broker keeps a pool of providers; a backup takes over when one quits.",
    "Models travel as ONNX, so one job can span machines with different GPUs.",
    "Hello world! Generation streams tokens one at a time through the pipeline.",
]


def tiny_tokenizer(path: Any, vocab_size: int = 512) -> None:
    """A byte-level BPE tokenizer with `vocab_size` entries, "<|endoftext|>" at id 0, trained
    on a few sentences (deterministic), written as a tokenizers JSON file at `path`."""
    from cli.demo_models import bpe_tokenizer

    bpe_tokenizer(CORPUS, path, vocab_size)


# Small random models of each rotary decoder family, configured so that each family's own
# features take effect on a 6-token prompt plus 24 new tokens: `feature -> config change` that
# switches one off (the tests show each changes the logits).
COMMON = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=128,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, dict[str, Any]]]] = {
    "llama": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        {"llama3 rope": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    "mistral": (
        "MistralConfig",
        {"sliding_window": 4},
        {"sliding window": {"sliding_window": None}},
    ),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": 4},
        {"sliding window": {"use_sliding_window": False}, "qkv bias": {}},
    ),
    "qwen3": ("Qwen3Config", {}, {"q/k norms": {}}),
    "phi3": (
        "Phi3Config",
        {
            "sliding_window": 5,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.0, 1.0, 1.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
                "original_max_position_embeddings": 16,
            },
            "original_max_position_embeddings": 16,
            "initializer_range": 0.1,
        },
        {
            "sliding window": {"sliding_window": None},
            "partial rotary, longrope": {
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
            },
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": 4,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 1.0,
            "initializer_range": 0.05,
        },
        {
            "sliding window": {"sliding_window": 4096},
            "attention soft-cap": {"attn_logit_softcapping": None},
            "final soft-cap": {"final_logit_softcapping": None},
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "sliding_window": 4,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 1.0,
            "initializer_range": 0.03,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        },
        {
            "sliding window": {"sliding_window": 4096},
            "local rope base": {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                }
            },
            "final soft-cap": {"final_logit_softcapping": None},
            "q/k norms": {},
        },
    ),
}


SEEDS = {"gemma2": 4, "gemma3": 4}  # seeds whose greedy answers have no near ties


def family_model(family: str, seed: int | None = None, **change: Any) -> Any:
    """A random model of `family` (`change` overrides its config), with biases and norm
    weights random too: transformers starts them at 0 or 1, where they would change nothing."""
    import torch
    import transformers

    cls, extra, _ = FAMILIES[family]
    config = getattr(transformers, cls)(**{**COMMON, **extra, **change})
    torch.manual_seed(SEEDS.get(family, 3) if seed is None else seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(
                    torch.randn_like(p) * 0.2
                    + (0.0 if "gemma" in family else 1.0) * ("norm" in name)
                )
    return model.eval()


def hf_answer(model: Any, prompt: list[int], tokens: int) -> list[int]:
    """transformers' greedy answer, stopping after end-of-sequence as the swarm does."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
    answer = [int(t) for t in out[0, len(prompt) :]]
    eos = model.config.eos_token_id
    return answer[: answer.index(eos) + 1] if eos in answer else answer


# A ChatML-style chat template (written for these tests): a default system message through a
# namespace, roles checked with raise_exception, and each turn closed by `eos_token`.
CHATML = """{%- set ns = namespace(system=false) -%}
{%- for m in messages -%}
  {%- if m['role'] not in ['system', 'user', 'assistant'] -%}
    {{- raise_exception('roles are system, user and assistant, not ' + m['role']) -}}
  {%- endif -%}
  {%- if m['role'] == 'system' -%}{%- set ns.system = true -%}{%- endif -%}
{%- endfor -%}
{%- if not ns.system -%}
  {{- '<|im_start|>system\\nYou are a helpful assistant.' + eos_token + '\\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {{- '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + eos_token + '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""


def chat_tokenizer(directory: Any, template: str = CHATML) -> Any:
    """A transformers tokenizer (the tests' BPE plus <|im_start|> and <|im_end|>, the end of
    a turn) with `template`, saved into `directory`."""
    from pathlib import Path

    import transformers
    from tokenizers import Tokenizer

    from cli.demo_models import bpe_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe_tokenizer(CORPUS, directory / "tokenizer.json", 512)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )
    fast.save_pretrained(directory)
    return fast


def chat_model(directory: Any, stops: list[int] | None = None) -> tuple[Any, Any]:
    """A 4-block random Llama with `chat_tokenizer`, saved into `directory` as a transformers
    folder whose generation_config.json declares `stops` as its end-of-turn ids (default:
    <|im_end|>). Returns (model, tokenizer)."""
    import torch
    import transformers

    tok = chat_tokenizer(directory)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tok),
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=end,
        pad_token_id=tok.pad_token_id,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = list(stops) if stops else end
    model.save_pretrained(directory)
    return model, tok


def hf_chat(
    model: Any, tok: Any, messages: list[dict[str, str]], n: int, stops: list[int] | None
) -> tuple[list[int], str]:
    """transformers' own answer: the chat template with the generation prompt, then greedy
    `generate` stopping at `stops` (None: run all `n` tokens). (answer ids, decoded text)"""
    import torch

    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
        )
    answer = out[0, ids.shape[1] :].tolist()
    if stops is None:
        assert len(answer) == n
    return answer, tok.decode(answer, skip_special_tokens=True)


def greedy_with_gaps(package: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """A package's greedy tokens after `prompt` in this process, alone (one thread), and the
    gap between the top two logits at each step: where it is tiny, another run's rounding may
    pick the other token (a batched run must give these tokens but there)."""
    import numpy as np

    from ir.executors.ort import OrtExecutor
    from ir.package import load_package
    from ir.pipeline import LocalPipeline

    loaded = load_package(package)
    runs = [OrtExecutor(loaded.models[s.index], threads=1) for s in loaded.manifest.stages]
    pipe = LocalPipeline(loaded.manifest, runs)
    cache, fed, tokens, gaps = pipe.new_cache(), 0, list(prompt), []
    for _ in range(steps):
        logits = pipe.step(np.array([tokens[fed:]], dtype=np.int64), fed, cache)[0, -1]
        fed = len(tokens)
        top = np.sort(logits.astype(np.float64))[-2:]
        gaps.append(float(top[1] - top[0]))
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt) :], gaps


# How close the top two logits of a lone run may be where a batched run of the same package
# picks the other: its matrix products add in another order and round otherwise. fp16 logits
# keep about 3 digits: a run of 16 sessions here once picked the other token where the two were
# 2**-9 apart, one unit in the last place at their size, and ties (gap 0) occur.
ROUNDING = {"fp32": 1e-4, "fp16": 1e-2}


def same_as_alone(
    got: list[int], alone: list[int], gaps: list[float], gap: float = ROUNDING["fp32"]
) -> bool:
    """`got` equals the tokens generated alone, but where it first differs the alone run's top
    two logits were within `gap` of each other (what follows then differs as it may)."""
    for n, (a, b) in enumerate(zip(got, alone, strict=True)):
        if a != b:
            return gaps[n] < gap
    return True


def tokenizer_of(package: Path) -> Path:
    """A package's tokenizer file (named in its manifest)."""
    import json

    name = json.loads((package / "manifest.json").read_text())["tokenizer"]
    return package / name


def whole_cache_stage(model: Any, info: Any) -> tuple[Any, Any]:
    """A decoder stage (`onnx.ModelProto`, `StageInfo`) as packages split before stages output
    only their new keys and values built it: each block's cache output is its whole cache
    again, past then new (`present_*`: a copy of the cache every step)."""
    import msgspec
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    for out in model.graph.output:
        if out.name.startswith("new_"):
            past, present = out.name.replace("new_", "past_"), out.name.replace("new_", "present_")
            model.graph.node.append(
                onnx.helper.make_node("Concat", [past, out.name], [present], axis=2)
            )
            out.name = present
            out.type.tensor_type.shape.dim[2].dim_param = "total"
    outputs = [
        msgspec.structs.replace(
            o, name=o.name.replace("new_", "present_"), shape=[*o.shape[:2], "total", *o.shape[3:]]
        )
        if o.name.startswith("new_")
        else o
        for o in info.outputs
    ]
    return model, msgspec.structs.replace(info, outputs=outputs)
