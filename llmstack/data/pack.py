"""Tokenize documents (read by `reader`) and pack them into indexed shards."""

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from llmstack.errors import UserError

from .indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from .mixture import SourceShare, token_shares
from .reader import (
    expand_paths,
    iter_documents,
    read_documents,  # noqa: F401  (llmstack.cli.quickstart imports it from here)
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pack_documents(
    texts: Iterable[str],
    tokenizer: "PreTrainedTokenizerBase",
    out_prefix: str | Path,
    batch_size: int = 512,
    total: int | None = None,
) -> tuple[int, int]:
    """Tokenize each text, append EOS, and write `out_prefix.bin/.idx`. Returns (documents, tokens)."""
    eos = tokenizer.eos_token_id
    encode = batch_encoder(tokenizer)
    n_docs = n_tokens = 0
    texts = iter(texts)
    with (
        IndexedDatasetWriter(out_prefix, best_dtype(len(tokenizer))) as writer,
        tqdm(total=total, desc=f"pack {os.path.basename(str(out_prefix))}", unit="doc", disable=None) as bar,
    ):
        while batch := list(itertools.islice(texts, batch_size)):
            for token_ids in encode(batch):
                ids = np.asarray(token_ids + [eos])
                writer.add_document(ids)
                n_tokens += len(ids)
            n_docs += len(batch)
            bar.update(len(batch))
    return n_docs, n_tokens


def batch_encoder(tokenizer: "PreTrainedTokenizerBase") -> Callable[[list[str]], list[list[int]]]:
    """Token ids of a batch of texts without special tokens: straight through the Rust tokenizer
    when there is one (no per-call BatchEncoding, no max-length warnings), else the tokenizer's call."""
    if tokenizer.is_fast:
        backend = tokenizer.backend_tokenizer
        return lambda batch: [enc.ids for enc in backend.encode_batch(batch, add_special_tokens=False)]
    return lambda batch: tokenizer(batch, add_special_tokens=False)["input_ids"]


def pack_files(
    paths: str | Sequence[str | Path],
    tokenizer_dir: str | Path,
    out_prefix: str | Path,
    text_field: str = "text",
    workers: int = 1,
    text_unit: str = "document",
) -> tuple[list[str], int, int]:
    """Pack each data file into its own shard `out_prefix-00000.bin/.idx`, ... in `workers` processes.

    Shards appear only once complete and one whose .idx exists is kept, so a killed job rerun with
    the same files packs only the missing ones. Empty files get no shard. Returns
    (shard prefixes, documents, tokens) over all shards.
    """
    files = [f for f in expand_paths(paths) if os.path.getsize(f) > 0]
    if not files:
        raise UserError(f"every data file of {paths} is empty")
    shards = [f"{out_prefix}-{i:05d}" for i in range(len(files))]
    todo = [
        (f, tokenizer_dir, s, text_field, text_unit) for f, s in zip(files, shards) if not os.path.exists(f"{s}.idx")
    ]
    if workers > 1 and len(todo) > 1:
        workers = min(workers, len(todo))
        context = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_share_cores, initargs=(workers,)) as pool:
            list(pool.map(_pack_file, *zip(*todo)))
    else:
        for task in todo:
            _pack_file(*task)
    datasets = [IndexedDataset(s) for s in shards]
    return shards, sum(len(d) for d in datasets), sum(d.num_tokens for d in datasets)


def shards_by_pattern(paths: Sequence[str], shards: Sequence[str]) -> list[list[str]]:
    """`pack_files`' shard prefixes grouped by the pattern of `paths` their files came from."""
    groups, start = [], 0
    for pattern in paths:
        count = sum(os.path.getsize(f) > 0 for f in expand_paths([pattern]))
        groups.append(list(shards[start : start + count]))
        start += count
    return groups


def pack_token_shares(
    paths: Sequence[str], shards: Sequence[str], weights: Sequence[float], names: Sequence[str] | None = None
) -> list[SourceShare]:
    """Each pattern of `paths` as a source (in `pack_files`' order of shards), named by `names`
    (default: the patterns): its shards' tokens against its target weight."""
    names = list(paths) if not names else list(names)
    groups = shards_by_pattern(paths, shards)
    tokens = {name: sum(IndexedDataset(s).num_tokens for s in group) for name, group in zip(names, groups)}
    return token_shares(tokens, dict(zip(names, map(float, weights), strict=True)))


def mixture_sources(
    paths: Sequence[str], shards: Sequence[str], weights: Sequence[float], names: Sequence[str] | None = None
) -> list[dict]:
    """The `data.train` mixture of the packed patterns: [{name, prefixes, weight}], named by
    `names` (default: the patterns)."""
    names = list(paths) if not names else list(names)
    groups = shards_by_pattern(paths, shards)
    return [{"name": n, "prefixes": g, "weight": float(w)} for n, g, w in zip(names, groups, weights, strict=True)]


def _pack_file(
    path: str, tokenizer_dir: str | Path, out_prefix: str, text_field: str, text_unit: str
) -> tuple[int, int]:
    from .tokenizer import load_tokenizer

    texts = (doc.text for doc in iter_documents([path], text_field, text_unit))
    return pack_documents(texts, load_tokenizer(tokenizer_dir), out_prefix)  # type: ignore[arg-type]


def _share_cores(workers: int) -> None:
    """Give each worker's `encode_batch` thread pool its share of the cores, not all of them."""
    os.environ["RAYON_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
