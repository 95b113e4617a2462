"""Random streams under tensor parallelism.

Activations outside the tensor-parallel region are replicated across its ranks, so dropout there
must draw the same mask on every rank, or the replicas drift apart. Inside the region each rank
holds different heads, and their dropout masks must differ, as they would in the unsplit model.
So each rank keeps two streams (Megatron-LM's scheme): the default generator, seeded alike on all
tensor-parallel ranks, and a tensor-parallel stream, seeded per rank, forked into for the code
inside the region.

The tensor-parallel stream lives in DeepSpeed's RNG tracker, which DeepSpeed's activation
checkpointing saves and restores, so recomputed dropout masks equal the original ones.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from llmstack.compat.deepspeed import rng_tracker

if TYPE_CHECKING:
    from .topology import Topology

# DeepSpeed's default tracker name: the one its checkpointing and Megatron code fork into.
TENSOR_PARALLEL_RNG = "model-parallel-rng"


def model_parallel_seed(seed: int, topology: "Topology") -> None:
    """Seed this rank's streams; call it on every rank instead of torch.manual_seed.

    Default generator: seed + 100 x pipeline stage, alike across tensor- and data-parallel ranks.
    Tensor-parallel stream: that + 2718 + tensor-parallel rank.
    """
    seed = seed + 100 * topology.pipeline_parallel_rank
    torch.manual_seed(seed)
    tracker = rng_tracker()
    tracker.reset()
    tracker.add(TENSOR_PARALLEL_RNG, seed + 2718 + topology.tensor_parallel_rank)


@contextmanager
def tensor_parallel_rng() -> Iterator[None]:
    """Run the enclosed code on this rank's tensor-parallel random stream."""
    tracker = rng_tracker()
    if TENSOR_PARALLEL_RNG not in tracker.get_states():
        raise RuntimeError(
            "dropout inside tensor-parallel layers needs llmstack.parallel.model_parallel_seed(seed, topology) "
            "to be called first"
        )
    with tracker.fork(TENSOR_PARALLEL_RNG):
        yield
