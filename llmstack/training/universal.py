"""DeepSpeed's universal checkpoint: every parameter whole, with its optimizer state, one folder each
(`zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`), whatever the ZeRO stage and the data-, tensor- and
pipeline-parallel sizes that saved it. llmstack uses it to resume on another number of ranks.

The conversion is DeepSpeed's `ds_to_universal`, run in this process with safe loading; it needs
the `universal_checkpoint_info` entry that CheckpointManager saves with every checkpoint.
"""

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch

from llmstack.compat.deepspeed import checkpoint_files, universal_checkpoint_loading
from llmstack.compat.deepspeed import convert_to_universal as ds_to_universal
from llmstack.errors import UserError
from llmstack.safe_load import safe_loading

# Saved with every checkpoint so that ds_to_universal accepts it (Megatron-DeepSpeed does the same).
UNIVERSAL_CHECKPOINT_INFO = {"universal_checkpoint_version": 0.2}


def saved_layout(tag_dir: str) -> tuple[int, int]:
    """(data-parallel size, model-parallel size) of the ZeRO shards in `tag_dir`; (0, 0) for a
    checkpoint without ZeRO shards (stage 0), which loads on any number of ranks."""
    return checkpoint_files(tag_dir).zero_layout()


def convert_to_universal(tag_dir: str, out_dir: str) -> None:
    """Write the universal form of checkpoint `tag_dir` to `out_dir` (its parent gets a
    `latest_universal` file naming it)."""
    log = io.StringIO()
    try:
        with safe_loading(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal(tag_dir, out_dir)
    except Exception as e:
        raise UserError(
            f"could not convert checkpoint {tag_dir} to DeepSpeed's universal format: {e}\n{log.getvalue()[-2000:]}"
        ) from e


@contextlib.contextmanager
def loading_universal(engine: Any) -> Iterator[None]:
    """Within the block, engine.load_checkpoint reads universal checkpoints. DeepSpeed takes this
    from its config (`checkpoint.load_universal`), which is fixed at initialize; it is only read
    while loading, so it is switched on for the load alone.

    DeepSpeed's ZeRO-3 universal load also gives every parameter group the first group's
    hyperparameters, weight decay included (DeepSpeed 0.19.8, stage3.py); the run's own are put
    back afterwards, all but the learning rate, which comes from the checkpoint. It also gives
    every partition's optimizer state one and the same `step` object, which torch's AdamW
    increments in place, once per partition and step: each gets its own copy."""
    hyperparameters = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in engine.optimizer.param_groups]
    with universal_checkpoint_loading(engine):
        yield
    for group, values in zip(engine.optimizer.param_groups, hyperparameters):
        group.update(values)
    for state in engine.basic_optimizer.state.values():  # basic_optimizer: checked by compat at start-up
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    for state in engine.basic_optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
