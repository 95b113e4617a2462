"""Incremental detokenization: streamed pieces add up to the whole decode, stop strings cut it, and
each push decodes a short window rather than the whole completion."""

import random

import pytest
from inference_fixtures import TEXT

from llmstack.data.tokenizer import train_tokenizer
from llmstack.inference.text_stream import IncrementalText, first_stop

CHINESE = ["数据清洗以后，模型在中文网页文本上继续预训练。", "分词器把汉字拆成字节，流式输出不能把半个字送出去。"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """Byte-level BPE too small to hold most Chinese characters whole: they split into byte tokens."""
    return train_tokenizer(TEXT + CHINESE, vocab_size=400, out_dir=str(tmp_path_factory.mktemp("tokenizer")))


def stream(tokenizer, ids, stop_strings=(), chunk=1):
    text = IncrementalText(tokenizer, stop_strings)
    pieces = [text.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [text.finish()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_pieces_add_up_to_the_whole_decode_and_never_split_a_character(tokenizer, chunk):
    ids = tokenizer("".join(CHINESE[:2] + TEXT[:2]) * 3)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some characters span tokens
    pieces = stream(tokenizer, ids, chunk=chunk)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_with_invalid_bytes_stream_to_the_whole_decode(tokenizer, seed):
    ids = random.Random(seed).choices(range(2, len(tokenizer)), k=300)
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_stop_strings_cut_the_streamed_text_before_the_first_of_them(tokenizer):
    ids = tokenizer("".join(CHINESE[:2] + TEXT[:3]))["input_ids"]
    whole = tokenizer.decode(ids)
    for stops in (["quick brown"], ["模型", "quick"], ["never there"], ["。", "ret"]):
        cut = first_stop(whole, stops)
        assert "".join(stream(tokenizer, ids, stops)) == whole[:cut]


def test_each_push_decodes_a_short_window(tokenizer, monkeypatch):
    ids = tokenizer("".join(CHINESE + TEXT))["input_ids"]
    assert len(ids) > 1000
    lengths = []
    decode = type(tokenizer).decode
    monkeypatch.setattr(
        type(tokenizer), "decode", lambda self, ids, **kw: lengths.append(len(ids)) or decode(self, ids, **kw)
    )
    assert "".join(stream(tokenizer, ids)) == decode(tokenizer, ids)
    assert max(lengths) <= 8  # a character's bytes plus one token of context, at any length
