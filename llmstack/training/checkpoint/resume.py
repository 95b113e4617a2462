"""Which saved layouts a run resumes from, and how: the checkpoints' layout rules, in one place.

A checkpoint tells its layout in two ways: llmstack's state file records the data-, tensor-,
pipeline- and expert-parallel sizes (`recorded`; absent from a trusted checkpoint written
elsewhere), and the names of DeepSpeed's ZeRO shard files give the data- and model-parallel sizes
(`zero_data`, `zero_model`; both 0 without ZeRO shards, at stage 0). `plan_resume` compares that
with the resuming run and answers "direct" (DeepSpeed loads the files as they are) or "universal"
(convert to DeepSpeed's universal format first, llmstack.training.checkpoint.universal), or
raises one UserError that says why not and what to do.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmstack.errors import UserError


@dataclass(frozen=True)
class SavedLayout:
    tag: str
    recorded: Mapping[str, Any] | None  # llmstack's state (with the four *_parallel_size keys), or None
    zero_data: int  # data-parallel size of the ZeRO shards (0: no shards)
    zero_model: int  # model-parallel size of the ZeRO shards (0: no shards)
    expert: int  # expert-parallel size of the expert files (1: experts not split)
    weights_partitioned: bool = False  # whether ZeRO-3 partitioned the weights (model states per data rank)

    def size(self, key: str, default: int) -> int:
        return int((self.recorded or {}).get(key, default))

    @property
    def records_model_parallel(self) -> bool:
        """Whether llmstack recorded how its parameters are split (the tensor and pipeline sizes)."""
        return self.recorded is not None and "tensor_parallel_size" in self.recorded

    def describe(self) -> str:
        return describe_layout(self.recorded, self.zero_data, self.zero_model)


def describe_layout(sizes: Mapping[str, Any] | None, data_parallel: int, model_parallel: int) -> str:
    """The parallel sizes of a run in words; `sizes`: the *_parallel_size keys (None: only the ZeRO
    shards' sizes are known)."""
    if sizes and "tensor_parallel_size" in sizes:
        return (
            f"data-parallel size {sizes['data_parallel_size']}, tensor-parallel size {sizes['tensor_parallel_size']} "
            f"and pipeline-parallel size {sizes['pipeline_parallel_size']}"
        )
    return f"data-parallel size {data_parallel} and model-parallel size {model_parallel}"


def plan_resume(
    saved: SavedLayout, here: Mapping[str, int], model_parallel: int, weights_partitioned: bool = False
) -> str:
    """ "direct" or "universal" for resuming `saved` on the run with sizes `here` (the *_parallel_size keys),
    model-parallel size `model_parallel` and ZeRO-3 (`weights_partitioned`) or not; UserError if the layout
    change cannot be carried."""
    _check_experts(saved, here, weights_partitioned)
    tensor_or_pipeline_changed = any(
        saved.size(key, here[key]) != here[key] for key in ("tensor_parallel_size", "pipeline_parallel_size")
    )
    # Tensor 2 and pipeline 2 both have model-parallel size 2: the recorded sizes tell them apart.
    model_parallel_changed = (saved.zero_data > 0 and saved.zero_model != model_parallel) or tensor_or_pipeline_changed
    here_words = describe_layout(here, here["data_parallel_size"], model_parallel)
    if saved.zero_data == 0:  # no ZeRO shards: the files load on any number of data-parallel ranks
        if model_parallel_changed and saved.recorded is not None:
            raise UserError(
                f"{saved.tag} was saved with {saved.describe()} and without ZeRO partitions (ZeRO stage 0), "
                f"which cannot be converted; this run has {describe_layout(here, 0, 0)}. "
                "Resume with the saved tensor and pipeline parallel sizes"
            )
        return "direct"
    if not model_parallel_changed and saved.zero_data == here["data_parallel_size"]:
        return "direct"
    if (saved.zero_model > 1 or model_parallel_changed) and not saved.records_model_parallel:
        raise UserError(
            f"{saved.tag} was saved with {saved.describe()} and this run has {here_words}: a model-parallel "
            "checkpoint saved before llmstack recorded how its parameters are split resumes only on its own "
            "layout. Resume with the saved data, tensor and pipeline parallel sizes"
        )
    if here["pipeline_parallel_size"] > 1 and saved.recorded and saved.size("pipeline_parallel_size", 1) == 1:
        raise UserError(
            f"{saved.tag} was saved with {saved.describe()} and this run has {here_words}: a pipeline resumes only "
            "from a pipeline's checkpoint (converting a checkpoint saved without pipeline parallelism into "
            "DeepSpeed's pipeline engine is not supported). Resume with train.pipeline_parallel_size 1 "
            "(any tensor-parallel and data-parallel size)"
        )
    return "universal"


def _check_experts(saved: SavedLayout, here: Mapping[str, int], weights_partitioned: bool) -> None:
    """A checkpoint with split experts resumes only on its expert-, data-, tensor- and
    pipeline-parallel sizes (its expert files and ZeRO's expert partitions follow them), and on its
    side of ZeRO-3 (whose shards hold the experts); nor do split experts resume from one without."""
    keys = ("expert_parallel_size", "data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")
    here_sizes = tuple(here[key] for key in keys)
    saved_dp = saved.size("data_parallel_size", saved.zero_data) or here["data_parallel_size"]
    saved_sizes = (saved.expert, saved_dp, *(saved.size(key, here[key]) for key in keys[2:]))
    if saved_sizes != here_sizes and not saved.expert == here["expert_parallel_size"] == 1:

        def words(sizes: tuple[int | None, ...]) -> str:
            ep, dp, tp, pp = sizes
            return (
                f"train.expert_parallel_size {ep} on data-parallel size {dp}, tensor-parallel size {tp} "
                f"and pipeline-parallel size {pp}"
            )

        recorded_dp = saved.size("data_parallel_size", saved.zero_data) or None
        raise UserError(
            f"{saved.tag} was saved with {words((saved.expert, recorded_dp, *saved_sizes[2:]))}; this run has "
            f"{words(here_sizes)}: checkpoints of split experts resume on the same expert-, data-, tensor- and "
            "pipeline-parallel sizes only. Resume with those sizes, or export the model (llmstack export-hf) and "
            "start a run from it (model.init_from)"
        )
    if saved.expert > 1 and saved.weights_partitioned != weights_partitioned:
        stage = {True: "ZeRO stage 3", False: "ZeRO stage 0, 1 or 2"}
        raise UserError(
            f"{saved.tag} was saved with train.expert_parallel_size {saved.expert} at "
            f"{stage[saved.weights_partitioned]} and this run is at {stage[weights_partitioned]}: DeepSpeed keeps "
            "split experts in other files at ZeRO-3 than below it, and such a checkpoint is not converted. Resume "
            f"at {stage[saved.weights_partitioned]}, or export the model (llmstack export-hf) and start a run from "
            "it (model.init_from)"
        )
