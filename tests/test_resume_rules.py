"""The checkpoints' layout rules (llmstack.training.checkpoint.resume), without a run: which saved
layouts load directly, which through DeepSpeed's universal format, and which are refused."""

import pytest

from llmstack.errors import UserError
from llmstack.training.checkpoint.resume import SavedLayout, plan_resume


def sizes(data=2, tensor=1, pipeline=1, expert=1):
    return {
        "data_parallel_size": data,
        "tensor_parallel_size": tensor,
        "pipeline_parallel_size": pipeline,
        "expert_parallel_size": expert,
    }


def saved(zero_data=2, zero_model=1, expert=1, **recorded):
    return SavedLayout("global_step4", sizes(**recorded), zero_data, zero_model, expert)


def test_the_same_layout_loads_directly_and_another_goes_through_the_universal_format():
    assert plan_resume(saved(), sizes(), model_parallel=1) == "direct"
    assert plan_resume(saved(), sizes(data=1), model_parallel=1) == "universal"
    assert plan_resume(saved(zero_model=2, data=1, tensor=2), sizes(data=2), model_parallel=1) == "universal"
    # Tensor 2 and pipeline 2 share model-parallel size 2; the recorded sizes tell them apart.
    assert plan_resume(saved(zero_data=1, zero_model=2, data=1, pipeline=2), sizes(data=1, tensor=2), 2) == "universal"


def test_a_checkpoint_without_zero_shards_loads_on_any_data_parallel_size_but_keeps_its_split():
    assert plan_resume(saved(zero_data=0, zero_model=0), sizes(data=1), model_parallel=1) == "direct"
    with pytest.raises(UserError, match="ZeRO stage 0"):
        plan_resume(saved(zero_data=0, zero_model=0, data=1, tensor=2), sizes(), model_parallel=1)


@pytest.mark.parametrize(
    ("checkpoint", "here", "model_parallel", "message"),
    [
        (saved(expert=2), sizes(data=1), 1, "split experts resume on the same"),
        (saved(), sizes(expert=2), 1, "split experts resume on the same"),
        (saved(expert=2, zero_model=2, pipeline=2), sizes(expert=2), 1, "pipeline-parallel size 2; this run"),
        (saved(data=1, zero_data=1), sizes(data=1, pipeline=2), 2, "a pipeline resumes only from a pipeline"),
        (SavedLayout("global_step4", None, 1, 2, 1), sizes(data=2), 1, "before llmstack recorded"),
    ],
)
def test_layout_changes_a_checkpoint_cannot_carry_are_refused_with_the_way_out(
    checkpoint, here, model_parallel, message
):
    with pytest.raises(UserError, match=message):
        plan_resume(checkpoint, here, model_parallel)


def test_split_experts_resume_on_their_side_of_zero3_only():
    zero3 = SavedLayout("global_step4", sizes(expert=2), 2, 1, 2, weights_partitioned=True)
    assert plan_resume(zero3, sizes(expert=2), model_parallel=1, weights_partitioned=True) == "direct"
    with pytest.raises(UserError, match="saved with train.expert_parallel_size 2 at ZeRO stage 3 and this run is at"):
        plan_resume(zero3, sizes(expert=2), model_parallel=1)
    with pytest.raises(UserError, match="at ZeRO stage 0, 1 or 2 and this run is at ZeRO stage 3"):
        plan_resume(saved(expert=2), sizes(expert=2), model_parallel=1, weights_partitioned=True)
    assert plan_resume(saved(), sizes(), model_parallel=1, weights_partitioned=True) == "direct"  # no split experts
