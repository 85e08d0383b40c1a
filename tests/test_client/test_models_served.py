"""Models from the new sources, served by real provider processes: a Q4_0 GGUF file split by
`fusionai ir split` into int4 provider stages (its blocks carried over), and a Phi-3
(longrope, sliding window, partial RoPE) whose generation crosses longrope's switch, where the
client runs the whole text again on fresh provider sessions. Each answer is transformers' own
greedy answer for the same weights."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.procs import ROOT
from tests.test_broker.conftest import BrokerProc, add_model, wait_ready
from tests.test_client.test_sdk import Spawner, start_providers

pytest.importorskip("gguf")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # 30 s of real processes
PROMPT = [5, 17, 42, 7, 99, 3]
NEW = 24


def split_cli(source: Path, out: Path, name: str) -> None:
    command = [sys.executable, "-m", "cli.main", "ir", "split", str(source), "--stages", "2"]
    done = subprocess.run(
        [*command, "--out", str(out), "--name", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 4 stages" in done.stdout


async def test_a_gguf_and_a_longrope_phi3_generate_transformers_tokens_through_providers(
    broker: Spawner, provider: Spawner, tmp_path: Path
) -> None:
    from client import AsyncClient
    from tests.gguf_files import uniform, write_gguf
    from tests.test_ir.test_gguf import gguf_llama
    from tests.tiny_models import family_model, hf_answer, tiny_tokenizer

    tiny_tokenizer(tmp_path / "tok.json", 512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = write_gguf(
            gguf_llama(),
            tmp_path / "tiny-q4.gguf",
            uniform("Q4_0"),
            tokenizer=tmp_path / "tok.json",
        )  # its 4-bit blocks stay 4-bit blocks in the provider stages
        split_cli(tmp_path / "tiny-q4.gguf", tmp_path / "gguf-pkg", "tiny-q4")
        phi3 = family_model("phi3")
        phi3.save_pretrained(tmp_path / "phi3-hf")
        split_cli(tmp_path / "phi3-hf", tmp_path / "phi3-pkg", "tiny-phi3")
    expected = {
        "tiny-q4": hf_answer(reference, PROMPT, NEW),
        "tiny-phi3": hf_answer(phi3, PROMPT, NEW),
    }
    assert all(len(set(t)) > 4 for t in expected.values()), expected

    b: BrokerProc = broker()
    start_providers(b, provider, (), (), ())
    for name in expected:
        add_model(b.http, tmp_path / ("gguf-pkg" if "q4" in name else "phi3-pkg"))
        wait_ready(b.http, name)
    async with AsyncClient(b.http, cache_dir=tmp_path / "cache", timeout=30) as fa:
        for name, tokens in expected.items():
            result = await fa.generate(PROMPT, NEW, temperature=0, model=name, stream=False)
            assert result.tokens == tokens, name
            assert not result.failovers, name
