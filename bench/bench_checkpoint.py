"""Checkpoint save and load throughput against the disk's raw sequential write and read, measured
in the same run on the same bytes: a ZeRO-2 engine over a ~30M-parameter model (fp32 weights,
AdamW moments: ~0.5 GB per checkpoint), one process.

    save  = CheckpointManager.save (DeepSpeed's files + RNG/state JSON, CRC-32 while writing,
            fsync, manifest, rename)                  vs writing as many bytes with write+fsync
    load  = CheckpointManager.load (CRC-32 check of every file, then DeepSpeed's load)
                                                      vs reading those files back
    async = how long training waits for an async save (the in-memory copy) vs a synchronous one

Reads start cold: the files' pages are dropped from the page cache (posix_fadvise) first.
Targets: save >= 0.5x raw write, load >= 0.5x raw read, async stall <= 0.5x the synchronous save.

    python bench/bench_checkpoint.py [--rounds 3] [--dir DIR]
"""

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time

import torch

from llmstack import LLMStackConfig, LLMStackForCausalLM

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8)
CHUNK = 1 << 24


def files_under(directory):
    return [p for p in glob.glob(os.path.join(directory, "**", "*"), recursive=True) if os.path.isfile(p)]


def drop_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(directory, sizes):
    """Write files of `sizes` bytes sequentially, each fsynced; returns seconds."""
    os.makedirs(directory)
    data = os.urandom(CHUNK)
    start = time.perf_counter()
    for i, size in enumerate(sizes):
        with open(os.path.join(directory, f"raw{i}"), "wb") as f:
            for offset in range(0, size, CHUNK):
                f.write(memoryview(data)[: min(CHUNK, size - offset)])
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(paths):
    drop_cache(paths)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(CHUNK):
                pass
    return time.perf_counter() - start


def build_engine():
    import deepspeed

    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG)).train()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2},
        },
    )
    batch = torch.randint(0, CONFIG["vocab_size"], (1, 65))
    engine.backward(engine(input_ids=batch[:, :-1], shift_labels=batch[:, 1:]).loss)
    engine.step()  # the optimizer moments exist from here on
    return engine, model.config


def manager(engine, model_config, directory, async_save):
    from llmstack.training.checkpoint.manager import CheckpointManager
    from llmstack.training.config import TrainConfig

    return CheckpointManager(directory, engine, TrainConfig(keep_last=1, async_save=async_save), {}, (model_config,))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    from llmstack.training.distributed import init_distributed

    init_distributed()
    engine, model_config = build_engine()
    print(f"model: {sum(p.numel() for p in engine.module.parameters()) / 1e6:.1f}M parameters, ZeRO-2, 1 rank")
    rates = {"save": [], "raw write": [], "load": [], "raw read": [], "async stall": [], "sync save": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for step in range(1, args.rounds + 1):
            sync_dir = os.path.join(root, "sync")
            checkpoints = manager(engine, model_config, sync_dir, async_save=False)
            start = time.perf_counter()
            checkpoints.save(step, step, {})
            save_s = time.perf_counter() - start
            tag_files = files_under(os.path.join(sync_dir, f"global_step{step}"))
            total = sum(os.path.getsize(p) for p in tag_files)

            raw_dir = os.path.join(root, f"raw{step}")
            write_s = raw_write(raw_dir, [os.path.getsize(p) for p in tag_files])
            read_s = raw_read(files_under(raw_dir))
            shutil.rmtree(raw_dir)

            drop_cache(tag_files)
            start = time.perf_counter()
            checkpoints.load(os.path.join(sync_dir, f"global_step{step}"))
            load_s = time.perf_counter() - start

            background = manager(engine, model_config, os.path.join(root, "async"), async_save=True)
            start = time.perf_counter()
            background.save(step, step, {})
            stall_s = time.perf_counter() - start
            background.wait()

            mb = total / 1e6
            for name, seconds in (("save", save_s), ("raw write", write_s), ("load", load_s), ("raw read", read_s)):
                rates[name].append(mb / seconds)
            rates["async stall"].append(stall_s)
            rates["sync save"].append(save_s)
            print(
                f"round {step}: {mb:.0f} MB; save {mb / save_s:.0f} MB/s (raw write {mb / write_s:.0f}), "
                f"load {mb / load_s:.0f} MB/s (raw read {mb / read_s:.0f}), async stall {stall_s:.2f}s "
                f"(sync save {save_s:.2f}s)"
            )

    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"save / raw write:       {median['save'] / median['raw write']:.2f}x  (target >= 0.5x)")
    print(f"load / raw read:        {median['load'] / median['raw read']:.2f}x  (target >= 0.5x)")
    print(f"async stall / sync save: {median['async stall'] / median['sync save']:.2f}x  (target <= 0.5x)")


if __name__ == "__main__":
    main()
