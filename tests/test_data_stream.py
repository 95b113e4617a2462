"""The training stream: mixture proportions, rank sharding, packing, exact mid-stream resume."""

import itertools
import json
import logging
import zlib
from collections import Counter

import pytest
import torch

from llmstack.data import seekable
from llmstack.data.stream import MixtureStream
from llmstack.data.tokenizer import train_tokenizer
from llmstack.errors import UserError

WEIGHTS = {"web": 0.67, "code": 0.045, "books": 0.285}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Each source in 4 files of 60 documents: "<source> <file> <doc> <filler words>"."""
    root = tmp_path_factory.mktemp("stream")
    for source in WEIGHTS:
        for f in range(4):
            with open(root / f"{source}-{f}.jsonl", "w") as out:
                for d in range(60):
                    out.write(json.dumps({"text": f"{source} {f} {d} " + "lorem " * (d % 9)}) + "\n")
    tokenizer = train_tokenizer((f"web code books {i} lorem" for i in range(200)), 300, root / "tokenizer")
    return root, tokenizer


def stream(corpus, sources=WEIGHTS, seq_len=16, seed=0, weight_by="tokens"):
    root, tokenizer = corpus
    return MixtureStream(
        [{"paths": str(root / f"{s}-*.jsonl"), "weight": w} for s, w in sources.items()],
        tokenizer,
        seq_len=seq_len,
        seed=seed,
        weight_by=weight_by,
    )


def take(iterable, n):
    """The next n items, pulling no more (zip(iterable, range(n)) would pull one more)."""
    return list(itertools.islice(iterable, n))


def test_mixture_proportions_within_two_percent_over_10k_documents(corpus):
    docs = take(stream(corpus).documents(dp_rank=1, dp_size=2), 10_000)
    counts = Counter(d["text"].split()[0] for d in docs)
    for source, weight in WEIGHTS.items():
        assert abs(counts[source] / 10_000 - weight) < 0.02, (source, counts)


def test_ranks_read_disjoint_files_whose_union_is_everything(corpus):
    seen = []
    for rank in range(2):  # one pass over the rank's share of the single source: 2 files x 60 documents
        seen.append({d["text"] for d in take(stream(corpus, {"web": 1}).documents(rank, 2), 120)})
    assert len(seen[0]) == len(seen[1]) == 120 and not seen[0] & seen[1]
    files = [{t.split()[1] for t in texts} for texts in seen]
    assert files[0] | files[1] == {"0", "1", "2", "3"} and not files[0] & files[1]
    with pytest.raises(UserError, match="not a multiple of the data-parallel size 3"):
        stream(corpus).documents(0, 3)


def test_blocks_are_the_token_stream_cut_with_one_token_overlap(corpus):
    _, tokenizer = corpus
    docs = take(stream(corpus, {"code": 1}).documents(), 40)
    tokens = [t for d in docs for t in tokenizer(d["text"])["input_ids"] + [tokenizer.eos_token_id]]
    batches = take(stream(corpus, {"code": 1}, seq_len=8).micro_batches(0, 3, 0, 1), 4)
    blocks = torch.cat(batches)
    assert blocks.shape == (12, 9) and blocks.dtype == torch.int64
    assert [b.tolist() for b in blocks] == [tokens[8 * k : 8 * k + 9] for k in range(12)]


def saved_after(corpus, micro_batches, micro=2, dp_size=2, rank=1, weight_by="tokens"):
    """The state a checkpoint saves after `micro_batches` micro-batches, as read back from JSON."""
    first = stream(corpus, weight_by=weight_by)
    take(first.micro_batches(0, micro, rank, dp_size), micro_batches)
    return json.loads(json.dumps(first.state_dict()))


def test_source_tokens_count_the_positions_of_the_blocks_yielded(corpus):
    root, tokenizer = corpus
    docs = take(stream(corpus).documents(), 200)
    sources = [str(root / f"{d['text'].split()[0]}-*.jsonl") for d in docs]
    owner = [s for d, s in zip(docs, sources) for _ in range(len(tokenizer(d["text"])["input_ids"]) + 1)]
    mixture = stream(corpus, seq_len=8, weight_by="documents")  # the documents' order above
    take(mixture.micro_batches(0, 3, 0, 1), 4)  # 12 blocks of 8 trained positions (+1 shared token)
    assert mixture.source_tokens == {name: Counter(owner[: 12 * 8])[name] for name in mixture.names}


@pytest.mark.parametrize("weight_by", ["tokens", "documents"])
def test_resume_mid_stream_gives_the_uninterrupted_batches(corpus, caplog, weight_by):
    micro, dp_size, rank = 2, 2, 1
    whole = stream(corpus, weight_by=weight_by)
    uninterrupted = take(whole.micro_batches(0, micro, rank, dp_size), 12)
    state = saved_after(corpus, 5, micro, dp_size, rank, weight_by)
    consumed = 5 * micro * dp_size

    restarted = stream(corpus, weight_by=weight_by)
    restarted.load_state_dict(state)
    with caplog.at_level(logging.WARNING, logger="llmstack.data.stream"):
        resumed = take(restarted.micro_batches(consumed, micro, rank, dp_size), 7)
    assert not caplog.records  # continued from the saved state, nothing replayed
    with caplog.at_level(logging.WARNING, logger="llmstack.data.stream"):
        replaying = stream(corpus, weight_by=weight_by)
        replayed = take(replaying.micro_batches(consumed, micro, rank, dp_size), 7)  # no saved state
    assert "replaying and re-tokenizing the stream up to block 10" in caplog.text
    for expected, a, b in zip(uninterrupted[5:], resumed, replayed, strict=True):
        assert torch.equal(expected, a) and torch.equal(expected, b)
    assert restarted.source_tokens == replaying.source_tokens == whole.source_tokens  # counts run on
    assert sum(whole.source_tokens.values()) == 12 * micro * 16


def test_a_stream_saved_on_two_ranks_is_refused_on_one_or_with_other_settings(corpus):
    state = saved_after(corpus, 3)
    resumed = stream(corpus)
    resumed.load_state_dict(state)
    with pytest.raises(
        UserError,
        match="saved by 2 data-parallel ranks.*continuing on 1 would repeat or skip "
        "documents. Resume with 2 data-parallel ranks",
    ):
        next(resumed.micro_batches(12, 2, 0, 1))
    changed = stream(corpus, seq_len=32)
    changed.load_state_dict(state)
    with pytest.raises(UserError, match="settings differ from the checkpoint's.*put data.sources"):
        next(changed.micro_batches(12, 2, 1, 2))
    by_documents = stream(corpus, weight_by="documents")  # as every stream saved before weight_by existed
    by_documents.load_state_dict(state)
    with pytest.raises(UserError, match="saved weighting its sources by tokens.*set data.weight_by=tokens"):
        next(by_documents.micro_batches(12, 2, 1, 2))


def test_bad_weights_and_empty_sources_are_user_errors(corpus):
    with pytest.raises(UserError, match="positive"):
        stream(corpus, {"web": 1, "code": 0})
    with pytest.raises(UserError, match="at least one source"):
        MixtureStream([], corpus[1], seq_len=8)


def compressed(data, fmt):
    """gzip: one member, a deflate block ended every 500 bytes; zstd: a frame every 500 bytes."""
    parts = [data[i : i + 500] for i in range(0, len(data), 500)]
    if fmt.endswith(".gz"):
        deflate = zlib.compressobj(6, zlib.DEFLATED, 31)
        return b"".join(deflate.compress(p) + deflate.flush(zlib.Z_SYNC_FLUSH) for p in parts) + deflate.flush()
    zstandard = pytest.importorskip("zstandard", reason="zstandard (the [data] extra) is not installed")
    return b"".join(zstandard.ZstdCompressor().compress(p) for p in parts)


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet", "jsonl.gz", "jsonl.zst"])
def test_a_resume_seeks_inside_the_file_instead_of_rereading_it(corpus, tmp_path, fmt, monkeypatch):
    """The saved place of a source is a byte offset (JSONL, text lines), a row (Parquet, row
    groups of 16) or a compressed file's seek point and offset (here every 512 B in gzip, every
    frame in zstd): the resumed stream gives the uninterrupted batches even after the part of the
    file before that place is overwritten with garbage, so nothing before it is read again."""
    _, tokenizer = corpus
    monkeypatch.setattr(seekable, "GZIP_SPACING", 512)
    texts = [f"doc {i} " + "lorem " * (i % 7) for i in range(400)]
    path = tmp_path / f"one.{fmt}"
    if fmt == "parquet":
        pyarrow, parquet = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        parquet.write_table(pyarrow.table({"text": texts}), path, row_group_size=16)
    else:
        lines = [json.dumps({"text": t}) if fmt.startswith("jsonl") else t for t in texts]
        data = ("\n".join(lines) + "\n").encode()
        path.write_bytes(compressed(data, fmt) if fmt.startswith("jsonl.") else data)
    source = {"name": "one", "paths": str(path), **({"text_unit": "line"} if fmt == "txt" else {})}

    def one():
        return MixtureStream([source], tokenizer, seq_len=16, tokenize_batch=8)

    uninterrupted = take(one().micro_batches(0, 2, 0, 1), 40)
    first = one()
    take(first.micro_batches(0, 2, 0, 1), 20)
    state = json.loads(json.dumps(first.state_dict()))
    place = state["dataset"]["parts"]["one"]
    end = 400 if fmt == "parquet" else len(data)  # rows, or (decompressed) bytes
    assert place["file"] == 0 and place["epoch"] == 0 and 0 < place["position"] < end
    if fmt.startswith("jsonl."):
        point = place["seek"]  # where the decompressor restarts, not far before the place
        assert 0 < place["position"] - point["uncompressed"] < 2048 and point["uncompressed"] > 1024
        assert "window" in point if fmt.endswith(".gz") else "window" not in point
        data = path.read_bytes()
        keep = point["compressed"] - (1 if point.get("bits") else 0)
        path.write_bytes(b"\xff" * keep + data[keep:])
    elif fmt != "parquet":
        data = path.read_bytes()
        assert data[place["position"] - 1 : place["position"]] == b"\n"  # a line boundary
        path.write_bytes(b"\xff" * (place["position"] - 1) + data[place["position"] - 1 :])
    resumed = one()
    resumed.load_state_dict(state)
    for expected, got in zip(uninterrupted[20:], take(resumed.micro_batches(40, 2, 0, 1), 20), strict=True):
        assert torch.equal(expected, got)


def documents_of(blocks, tokenizer):
    """(source, file, document) of each whole document in `blocks` (consecutive blocks overlap by a token)."""
    ids = [t for b in blocks[:1] for t in b[0].tolist()[:1]]
    for batch in blocks:
        for block in batch:
            ids.extend(block.tolist()[1:])
    docs, current = [], []
    for t in ids:
        if t != tokenizer.eos_token_id:
            current.append(t)
            continue
        source, f, d = tokenizer.decode(current).split()[:3]
        docs.append((source, int(f), int(d)))
        current = []
    return docs


def test_reweighting_adding_and_removing_sources_on_resume_repeats_and_skips_no_document(corpus):
    """Saved as web/code 0.5/0.5 after 30 micro-batches, resumed as web/books 0.2/0.8: every
    source's documents stay in its own order, none twice or left out (web continues where it was,
    books starts at its beginning, code stops), and the new weights hold from the resume on."""
    root, tokenizer = corpus

    def mixture(weights):
        sources = [{"name": s, "paths": str(root / f"{s}-*.jsonl"), "weight": w} for s, w in weights.items()]
        return MixtureStream(sources, tokenizer, seq_len=16)

    before = mixture({"web": 0.5, "code": 0.5})
    first = take(before.micro_batches(0, 2, 0, 1), 30)
    state = json.loads(json.dumps(before.state_dict()))
    after = mixture({"web": 0.2, "books": 0.8})
    after.load_state_dict(state)
    second = take(after.micro_batches(60, 2, 0, 1), 200)
    docs = documents_of(first + second, tokenizer)
    own_order = [(f, d) for f in range(4) for d in range(60)] * 3
    for source in ("web", "code", "books"):
        mine = [(f, d) for s, f, d in docs if s == source]
        assert mine == own_order[: len(mine)], source
    code_before = sum(s == "code" for s, _, _ in documents_of(first, tokenizer))
    assert 0 < sum(s == "code" for s, _, _ in docs) <= code_before + 1  # the document cut at the resume
    trained_after = Counter(after.source_tokens) - Counter(state["source_tokens"])
    assert trained_after["books"] / sum(trained_after.values()) == pytest.approx(0.8, rel=0.05)
    with pytest.raises(UserError, match="a source keeps its files under its name"):
        moved = MixtureStream([{"name": "web", "paths": str(root / "code-*.jsonl")}], tokenizer, seq_len=16)
        moved.load_state_dict(state)
        next(moved.micro_batches(60, 2, 0, 1))
