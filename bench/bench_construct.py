"""Peak host memory per rank while building a >= 1 GB (fp32) model on 2 ranks: whole construction
(every rank builds and initialises the whole model, as ZeRO 0-2 and tensor/pipeline parallelism
do) against ZeRO-3 partitioned construction (llmstack.training.construct: built under
deepspeed.zero.Init, initialised module by module), each also loading `model.init_from` weights.

Each figure is a rank's peak resident memory (VmHWM, reset through /proc/self/clear_refs) during
the phase, less its resident memory just before, as a multiple of the model's fp32 size. Each
setup runs in fresh processes, which first build a tiny model the same way, so that the modules
imported and the communication buffers set up on first use are not counted. Target for ZeRO-3 on 2
ranks: <= 0.5 + 0.1 (its half of the parameters plus one module or tensor in flight); whole
construction needs >= 1.

    python bench/bench_construct.py [--layers 5] [--keep DIR] [--construction zero3]

Whole construction on 2 ranks needs about 4 times the model size of free host memory (two ranks,
each with the model and the weights it loads); `--construction zero3` measures ZeRO-3 alone.
"""

import argparse
import os
import tempfile

from llmstack.testing import run_distributed

CONFIG = {
    "vocab_size": 8192,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
}
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}
SEQ_LEN = 256
WARM_UP = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 512,
}


def resident_kib():
    """(current, peak since the last reset) resident memory of this process, KiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measure(rank, world_size, stage, model_fields, tokenizer_dir):
    import gc

    from llmstack.data.tokenizer import load_tokenizer
    from llmstack.parallel import Topology
    from llmstack.training.construct import build_model
    from llmstack.training.distributed import init_distributed
    from llmstack.training.trainer import seed_everything

    init_distributed()
    topology, tokenizer = Topology(), load_tokenizer(tokenizer_dir)
    ds_config = {**DS_CONFIG, "zero_optimization": {"stage": stage}}
    build_model(WARM_UP, tokenizer, SEQ_LEN, ds_config, topology)
    gc.collect()
    before, _ = resident_kib()
    reset_peak()
    seed_everything(1234)
    model = build_model(model_fields, tokenizer, SEQ_LEN, ds_config, topology)
    _, peak = resident_kib()
    del model
    return (peak - before) * 1024


def write_model_dir(root, layers):
    """An llmstack model directory of the benchmark's size (random weights) with a tokenizer."""
    import torch

    from llmstack.data.tokenizer import train_tokenizer
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM

    tokenizer = train_tokenizer(["a few words to learn from"] * 50, 300, os.path.join(root, "tokenizer"))
    torch.manual_seed(0)
    model = LLMStackForCausalLM(LLMStackConfig(**CONFIG, num_hidden_layers=layers))
    path = os.path.join(root, "model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters()) * 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=5, help="decoder layers (5: 1.16 GB fp32)")
    parser.add_argument("--keep", help="directory for the model files (default: a temporary one)")
    parser.add_argument(
        "--construction", choices=("whole", "zero3"), action="append", help="measure only these (default: both)"
    )
    args = parser.parse_args()
    root = args.keep or tempfile.mkdtemp(prefix="bench_construct_")
    path, model_bytes = write_model_dir(root, args.layers)
    fresh = {**CONFIG, "num_hidden_layers": args.layers}
    print(
        f"model: {model_bytes / 2**30:.2f} GiB fp32 ({model_bytes // 4 / 1e6:.0f}M parameters), 2 ranks, "
        "peak host memory per rank during the phase, as a multiple of the fp32 model size"
    )
    print(f"{'construction':<28}{'phase':<22}{'rank 0':>8}{'rank 1':>8}")
    constructions = {"whole": ("whole (ZeRO 0-2, TP, PP)", 0), "zero3": ("ZeRO-3 partitioned", 3)}
    for name, stage in (constructions[c] for c in args.construction or constructions):
        for phase, fields in (("random init", fresh), ("init_from", {"init_from": path})):
            peaks = run_distributed(_measure, 2, args=(stage, fields, os.path.join(root, "tokenizer")))
            print(f"{name:<28}{phase:<22}" + "".join(f"{p / model_bytes:>8.2f}" for p in peaks), flush=True)


if __name__ == "__main__":
    main()
