"""Mixture of experts vs dense, same active parameters, on the quickstart corpus (the Python
stdlib's docstrings), fp32, one process, a plain PyTorch AdamW loop.

    dense   configs/quickstart.yaml's model: SwiGLU MLP of width 688
    moe     configs/moe.yaml's model: 8 experts of width 344, top-2 (the same MLP parameters
            per token), load-balancing loss 0.03, z-loss 0.001, dropless

Both train on the same blocks in the same order; their steps are timed interleaved in rounds, so
machine load hits them alike. Printed: tokens/s of each and their ratio (median over rounds), the
validation loss of each after the same tokens, and the MoE's expert load imbalance after warm-up
(target <= 1.5 with the auxiliary loss on): max/mean load per layer of each step, and of the load
summed over each window of --window steps (what the trainer logs as moe/imbalance with that
log_interval), each averaged over the steps or windows.

    python bench/bench_moe.py [--steps 300] [--rounds 6] [--warmup-steps 50] [--batch 8]
    python bench/bench_moe.py --models moe ...    # the load imbalance alone, in half the time
    python bench/bench_moe.py --aux-loss-coef 0.02 ...   # another load-balancing coefficient
"""

import argparse
import statistics
import time

import torch
import yaml
from corpus import stdlib_blocks  # bench/corpus.py

from llmstack import LLMStackConfig, LLMStackForCausalLM
from llmstack.models.loss import causal_lm_loss

SEQ, VOCAB = 256, 4096
MOE_FIELDS = (
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "router_aux_loss_coef",
    "router_z_loss_coef",
)


def model_configs(aux_loss_coef=None):
    with open("configs/moe.yaml") as f:
        moe_fields = yaml.safe_load(f)["model"]
    if aux_loss_coef is not None:
        moe_fields["router_aux_loss_coef"] = aux_loss_coef
    dense_fields = {k: v for k, v in moe_fields.items() if k not in MOE_FIELDS}
    common = {"vocab_size": VOCAB, "eos_token_id": 0, "max_position_embeddings": 1024}
    return {"dense": LLMStackConfig(**common, **dense_fields), "moe": LLMStackConfig(**common, **moe_fields)}


@torch.no_grad()
def validation_loss(model, blocks, batch_size):
    """Mean next-token NLL over `blocks` (the language-model loss alone, without auxiliary losses)."""
    model.eval()
    nll = [causal_lm_loss(model(input_ids=b[:, :-1]).logits, b[:, 1:]).item() for b in blocks.split(batch_size)]
    model.train()
    return statistics.fmean(nll)


def imbalance(loads, window):
    """Per layer, max/mean of the load summed over each `window` consecutive steps of `loads` (one
    (layers, experts) tensor per step), averaged over the windows."""
    windows = torch.stack(loads[: len(loads) // window * window]).unflatten(0, (-1, window)).mean(1)
    return (windows.amax(-1) * windows.shape[-1]).mean(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=50, help="steps before the load imbalance is averaged")
    parser.add_argument("--valid-blocks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="blocks of 256 tokens per step")
    parser.add_argument("--models", default="dense,moe", help="which to train: dense,moe (both: the ratios) or moe")
    parser.add_argument("--seed", type=int, default=0, help="of the initial weights and the order of the blocks")
    parser.add_argument("--window", type=int, default=20, help="steps per load window (the trainer's log_interval)")
    parser.add_argument("--aux-loss-coef", type=float, help="load-balancing loss (default: configs/moe.yaml)")
    args = parser.parse_args()
    batch_size = args.batch

    train, valid = stdlib_blocks(VOCAB, SEQ)
    valid = valid[: args.valid_blocks]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    models, optimizers = {}, {}
    for name, config in model_configs(args.aux_loss_coef).items():
        if name not in args.models.split(","):
            continue
        torch.manual_seed(args.seed)
        models[name] = LLMStackForCausalLM(config).train()
        optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=2e-3, weight_decay=0.1)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    print("parameters (the same per token): " + ", ".join(f"{name} {n / 1e6:.2f}M" for name, n in params.items()))

    steps_per_round = args.steps // args.rounds
    rates = {name: [] for name in models}
    loads, step = [], {name: 0 for name in models}  # per MoE step after warm-up: (layers, experts) load
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                batch = train[order[(torch.arange(batch_size) + step[name] * batch_size) % len(train)]]
                output = model(input_ids=batch[:, :-1], shift_labels=batch[:, 1:])
                loss = output.loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
                step[name] += 1
                if name == "moe" and step[name] > args.warmup_steps:
                    loads.append(torch.stack([s.load for s in output.router_stats]))
            rates[name].append(steps_per_round * batch_size * SEQ / (time.perf_counter() - start))
            print(f"{name}: step {step[name]}, loss {loss.item():.3f}, {rates[name][-1]:.0f} tokens/s", flush=True)
        if loads:  # how balancing progresses: the round's steps after warm-up, worst layer
            recent = [imbalance(loads[-steps_per_round:], w).max() for w in (1, args.window)]
            print(
                f"moe load imbalance (max/mean), this round, worst layer: {recent[0]:.2f} per step, "
                f"{recent[1]:.2f} per {args.window} steps",
                flush=True,
            )
    tokens = args.steps // args.rounds * args.rounds * batch_size * SEQ
    print("tokens/s: " + ", ".join(f"{name} {statistics.median(r):.0f}" for name, r in rates.items()))
    if len(rates) == 2:
        ratios = [m / d for m, d in zip(rates["moe"], rates["dense"])]
        spread = f"rounds: {min(ratios):.2f}-{max(ratios):.2f}"
        print(f"tokens/s ratio moe/dense: median {statistics.median(ratios):.2f} ({spread})")
    for name, model in models.items():
        print(f"validation loss after {tokens} tokens: {name} {validation_loss(model, valid, batch_size):.4f}")
    for window in (1, args.window):
        per_layer = imbalance(loads, window).tolist() if loads else []
        print(
            f"moe load imbalance (max/mean) after step {args.warmup_steps}, per {window} step(s), per layer: "
            + ", ".join(f"{v:.2f}" for v in per_layer)
            + f"; worst {max(per_layer, default=float('nan')):.2f} (target <= 1.5)"
        )


if __name__ == "__main__":
    main()
