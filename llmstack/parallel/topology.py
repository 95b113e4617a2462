"""The data x context x tensor x pipeline process grid, and the `mpu` DeepSpeed reads it through.

Rank layout (DeepSpeed's `PipeModelDataParallelTopology`, axes pipe, data, model; the last varies
fastest), where DeepSpeed's data axis holds data x context ranks, context varying fastest:

    replica = data_parallel_rank * context_parallel_size + context_rank
    rank = (pipeline_rank * data_parallel_size * context_parallel_size + replica) * tensor_parallel_size + tensor_rank

Tensor-parallel groups are runs of consecutive ranks. Launchers number the ranks of one node
consecutively, so when tensor_parallel_size divides the GPUs per node each tensor-parallel group
(an all-reduce per layer, the heaviest traffic) stays on the node's fast links; data-parallel
replicas come next, and pipeline stages (one point-to-point send per micro-batch, the lightest
traffic) are furthest apart, typically on different nodes. Example, 16 ranks as tensor 4 x data 2
x pipeline 2 on 2 nodes of 8 GPUs: node 0 holds stage 0 (tensor groups 0-3 and 4-7), node 1 holds
stage 1 (8-11 and 12-15).

The ranks of a context-parallel group (llmstack.parallel.context_parallel) read the same samples
and hold different tokens of them; `data_parallel_*` are the ranks reading different samples.
DeepSpeed sees every replica of the model (data x context ranks, `replica_group`) as data-parallel:
it averages the gradients over them (the ranks' token losses divided by one global target count
sum to the whole batch's loss) and ZeRO partitions over them.

`Topology` doubles as the `mpu` for `deepspeed.initialize(mpu=...)`: ZeRO then partitions the
optimizer state over the replicas only, and gradient norms are summed over the
model-parallel (tensor x pipeline) group with replicated parameters counted once.
"""

import logging
import os
from collections.abc import Iterable, Sequence

import torch.distributed as dist

from llmstack.compat.deepspeed import pipe_data_parallel_topology
from llmstack.errors import UserError

logger = logging.getLogger(__name__)


class Topology:
    """Process groups for tensor_parallel_size x pipeline_parallel_size x (the rest: data).

    Every rank must construct it, in the same order relative to other group creation, after
    torch.distributed is initialized.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("initialize torch.distributed (deepspeed.init_distributed()) before building a Topology")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        model_parallel_size = tensor_parallel_size * pipeline_parallel_size
        split = model_parallel_size * context_parallel_size
        if min(tensor_parallel_size, pipeline_parallel_size, context_parallel_size) < 1 or world_size % split:
            raise UserError(
                f"the world size ({world_size} processes) must be a multiple of train.tensor_parallel_size "
                f"({tensor_parallel_size}) x train.pipeline_parallel_size ({pipeline_parallel_size}) x "
                f"train.context_parallel_size ({context_parallel_size}) = {split}; launch a multiple of "
                f"{split} processes or change those sizes"
            )
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local_world_size % tensor_parallel_size:
            logger.warning(
                "tensor_parallel_size %d does not divide the %d processes per node: tensor-parallel groups "
                "span nodes and their per-layer all-reduces will be slow",
                tensor_parallel_size,
                local_world_size,
            )
        # DeepSpeed's data axis holds data x context ranks, context varying fastest.
        replicas = world_size // model_parallel_size
        self.layout = pipe_data_parallel_topology(pipeline_parallel_size, tensor_parallel_size, replicas)
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.context_parallel_size = context_parallel_size
        self.data_parallel_size = replicas // context_parallel_size
        coord = self.layout.get_coord(rank)
        self.tensor_parallel_rank = coord.model
        self.data_parallel_rank, self.context_parallel_rank = divmod(coord.data, context_parallel_size)
        self.pipeline_parallel_rank = coord.pipe

        # new_group is collective: every rank creates every group, in the same order.
        replica_lists = self.layout.get_axis_comm_lists("data")
        self.tensor_parallel_group = self._new_groups(self.layout.get_axis_comm_lists("model"), rank)
        self.data_parallel_group = self._new_groups(
            [ranks[c::context_parallel_size] for ranks in replica_lists for c in range(context_parallel_size)], rank
        )
        self.context_parallel_group = self.replica_group = self.data_parallel_group
        if context_parallel_size > 1:
            runs = range(0, replicas, context_parallel_size)
            contexts = [ranks[i : i + context_parallel_size] for ranks in replica_lists for i in runs]
            self.context_parallel_group = self._new_groups(contexts, rank)
            self.replica_group = self._new_groups(replica_lists, rank)
        self.pipeline_parallel_group = self._new_groups(self.layout.get_axis_comm_lists("pipe"), rank)
        model_parallel_lists = [self.layout.filter_match(data=d) for d in range(replicas)]
        self.model_parallel_group = self._new_groups(model_parallel_lists, rank)
        self.replica_ranks = next(r for r in replica_lists if rank in r)
        self.tensor_parallel_src_rank = rank - self.tensor_parallel_rank
        self._expert_groups(expert_parallel_size, rank)

    def _expert_groups(self, expert_parallel_size: int, rank: int) -> None:
        """Expert-parallel groups: runs of expert_parallel_size consecutive ranks of each data-parallel
        group (DeepSpeed's layout); expert-data-parallel groups: the ranks holding the same experts.
        None when expert_parallel_size is 1."""
        if expert_parallel_size < 1 or self.data_parallel_size % expert_parallel_size:
            raise UserError(
                f"train.expert_parallel_size ({expert_parallel_size}) must divide the data-parallel size "
                f"({self.data_parallel_size})"
            )
        self.expert_parallel_size = expert_parallel_size
        self.expert_parallel_group = self.expert_data_parallel_group = None
        if expert_parallel_size == 1:
            return
        ep_lists, edp_lists = [], []
        for dp_ranks in self.layout.get_axis_comm_lists("data"):
            ep_lists += [dp_ranks[i : i + expert_parallel_size] for i in range(0, len(dp_ranks), expert_parallel_size)]
            edp_lists += [dp_ranks[i::expert_parallel_size] for i in range(expert_parallel_size)]
        self.expert_parallel_group = self._new_groups(ep_lists, rank)
        self.expert_data_parallel_group = self._new_groups(edp_lists, rank)

    @staticmethod
    def _new_groups(rank_lists: Iterable[Sequence[int]], rank: int) -> dist.ProcessGroup | None:
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine

    def __repr__(self) -> str:
        return (
            f"Topology(tensor={self.tensor_parallel_size}, pipeline={self.pipeline_parallel_size}, "
            f"context={self.context_parallel_size}, data={self.data_parallel_size}; this rank: tensor "
            f"{self.tensor_parallel_rank}, pipeline {self.pipeline_parallel_rank}, context "
            f"{self.context_parallel_rank}, data {self.data_parallel_rank})"
        )

    # The mpu interface DeepSpeed calls (Megatron's parallel_state names).

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tensor_parallel_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tensor_parallel_size

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.tensor_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tensor_parallel_src_rank

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pipeline_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipeline_parallel_size

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.pipeline_parallel_group

    # DeepSpeed's data-parallel ranks are the replicas: data x context ranks, over which it
    # averages the gradients and partitions ZeRO's states (Megatron's data-parallel group with
    # context parallelism).

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_rank * self.context_parallel_size + self.context_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.replica_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.replica_ranks

    def get_model_parallel_rank(self) -> int:
        """Rank among the tensor x pipeline ranks holding one replica of the model."""
        return self.pipeline_parallel_rank * self.tensor_parallel_size + self.tensor_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.model_parallel_group
