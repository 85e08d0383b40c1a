"""Fixtures shared by the packages' tests: real child processes and model packages."""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.procs import Proc

# One thread per process for torch's OpenMP pool and numpy's OpenBLAS (both read it; set
# before either is imported, and inherited by the processes tests start). The suite runs a
# worker per core, each starting processes of its own: their default (a thread per core,
# spinning while it waits) then fights the other worker for both cores. Training the demo's
# decoder took 99 s beside one busy process with 2 threads and 7.8 s with 1 (8.6 s with 1
# thread alone, 9.5 with 2).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def minilm_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 split into two provider stages (plus client embed and head), with
    its tokenizer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cli.demo_models import build_minilm

    out = tmp_path_factory.mktemp("minilm")
    build_minilm(out, 2)
    return out


@pytest.fixture(scope="session")
def llama_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (4 blocks) split into two provider stages with KV-cache I/O,
    with a small byte-level BPE tokenizer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ir.export import build_package
    from tests.tiny_models import tiny_llama, tiny_tokenizer

    model = tiny_llama()
    out = tmp_path_factory.mktemp("llama")
    tokenizer = tmp_path_factory.mktemp("llama-tokenizer") / "tokenizer.json"
    tiny_tokenizer(tokenizer, model.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(model, 2, out, name="tiny-llama", tokenizer_file=tokenizer)
    return out


def int8_wire_copy(package: Path, out: Path) -> Path:
    """`package` sending hidden states between stages as int8 blocks: the same stage files
    (the format is the wire's, not the graph's; `ir split --wire int8` writes the same),
    its manifest saying so."""
    import msgspec

    from ir.export import wire_bytes
    from ir.manifest import MANIFEST_FILE, ModelManifest
    from ir.package import write_manifest

    shutil.copytree(package, out, dirs_exist_ok=True)
    manifest = ModelManifest.from_json((out / MANIFEST_FILE).read_bytes())
    stages = [
        msgspec.structs.replace(
            s, activation_bytes_per_token=wire_bytes(s.activation_bytes_per_token // 4, "int8")
        )
        for s in manifest.stages
    ]
    write_manifest(msgspec.structs.replace(manifest, stages=stages, wire="int8"), out)
    return out


@pytest.fixture(scope="session")
def minilm_int8_wire_package(
    minilm_package: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return int8_wire_copy(minilm_package, tmp_path_factory.mktemp("minilm-int8-wire"))


@pytest.fixture(scope="session")
def llama_int8_wire_package(llama_package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return int8_wire_copy(llama_package, tmp_path_factory.mktemp("llama-int8-wire"))


@pytest.fixture(scope="session")
def pretrain_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`fusionai ir init`'s package of the tiny config (2 stages), with a tokenizer trained on
    the shipped corpus: what pre-training tests train from scratch."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ir.scratch import CONFIGS, SHIPPED_DATA, init_package, read_texts

    out = tmp_path_factory.mktemp("pretrain") / "tiny"
    init_package(out, read_texts(SHIPPED_DATA), config=CONFIGS["llama-tiny"], stages=2, seed=0)
    return out


@pytest.fixture(scope="session")
def finetune_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small random Llama split into three provider stages, with LoRA adapter slots on
    the attention projections (q, k, v, o) of every block: what fine-tune tests train."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ir.export import build_package
    from ir.families import AdapterConfig
    from tests.tiny_models import tiny_llama, tiny_tokenizer

    model = tiny_llama()
    out = tmp_path_factory.mktemp("llama-ft")
    tokenizer = tmp_path_factory.mktemp("llama-ft-tokenizer") / "tokenizer.json"
    tiny_tokenizer(tokenizer, model.config.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_package(
            model,
            3,
            out,
            name="tiny-llama-ft",
            tokenizer_file=tokenizer,
            adapters=AdapterConfig(targets=("q", "k", "v", "o"), rank=4),
        )
    return out


@pytest.fixture(scope="session")
def llama3_packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The small random Llama in three provider stages with no end-of-sequence token (every
    generation runs its length), as fp32 and as fp16 stages: what batching tests run."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ir.export import Encoding, build_package
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    model.config.eos_token_id = None
    out = {}
    for name, encoding in [("fp32", Encoding()), ("fp16", Encoding(fp16=True))]:
        out[name] = tmp_path_factory.mktemp(f"llama3-{name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_package(model, 3, out[name], name=f"llama-{name}", encoding=encoding)
    return out


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def _spawn(args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, env)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        if proc.proc.poll() is None:
            proc.signal(signal.SIGKILL)
        proc.stop()
