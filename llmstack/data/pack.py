"""Read documents through `datasets` streaming, tokenize them and pack them into indexed shards."""

import glob
import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from tqdm import tqdm

from llmstack.errors import UserError

from .indexed import IndexedDataset, IndexedDatasetWriter, best_dtype

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def expand_paths(paths):
    """Files named by paths and globs, in sorted order; a pattern matching nothing is an error."""
    files = []
    for pattern in [paths] if isinstance(paths, str) else paths:
        matched = sorted(glob.glob(os.path.expanduser(str(pattern)), recursive=True))
        if not matched:
            raise UserError(f"no data file matches {pattern}")
        files.extend(matched)
    return files


def read_documents(paths, text_field="text"):
    """A streaming `datasets.IterableDataset` of the documents in JSONL, Parquet or text files.

    All files must have the same format. For text files each line is a document.
    """
    from datasets import load_dataset

    files = [f for f in expand_paths(paths) if os.path.getsize(f) > 0]
    if not files:
        raise UserError(f"every data file of {paths} is empty")
    kinds = {BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise UserError(f"data files must all be one of {', '.join(BUILDERS)}; got {files}")
    builder = kinds.pop()
    stream = load_dataset(builder, data_files=files, split="train", streaming=True)
    if builder != "text" and text_field != "text":
        stream = stream.rename_column(text_field, "text")
    return stream


def pack_documents(texts, tokenizer, out_prefix, batch_size=512, total=None):
    """Tokenize each text, append EOS, and write `out_prefix.bin/.idx`. Returns (documents, tokens)."""
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    n_docs = n_tokens = 0
    texts = iter(texts)
    with IndexedDatasetWriter(out_prefix, best_dtype(len(tokenizer))) as writer, tqdm(
        total=total, desc=f"pack {os.path.basename(str(out_prefix))}", unit="doc", disable=None
    ) as bar:
        while batch := list(itertools.islice(texts, batch_size)):
            for enc in backend.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids + [eos])
                writer.add_document(ids)
                n_tokens += len(ids)
            n_docs += len(batch)
            bar.update(len(batch))
    return n_docs, n_tokens


def pack_files(paths, tokenizer_dir, out_prefix, text_field="text", workers=1):
    """Pack each data file into its own shard `out_prefix-00000.bin/.idx`, ... in `workers` processes.

    Shards appear only once complete and one whose .idx exists is kept, so a killed job rerun with
    the same files packs only the missing ones. Empty files get no shard. Returns
    (shard prefixes, documents, tokens) over all shards.
    """
    files = [f for f in expand_paths(paths) if os.path.getsize(f) > 0]
    if not files:
        raise UserError(f"every data file of {paths} is empty")
    shards = [f"{out_prefix}-{i:05d}" for i in range(len(files))]
    todo = [(f, tokenizer_dir, s, text_field) for f, s in zip(files, shards) if not os.path.exists(f"{s}.idx")]
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


def _pack_file(path, tokenizer_dir, out_prefix, text_field):
    from .tokenizer import load_tokenizer

    texts = (row["text"] for row in read_documents([path], text_field))
    return pack_documents(texts, load_tokenizer(tokenizer_dir), out_prefix)


def _share_cores(workers):
    """Give each worker's `encode_batch` thread pool its share of the cores, not all of them."""
    os.environ["RAYON_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
