import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from inference_fixtures import tiny_model

from llmstack.data.blocks import PackedBlocks
from llmstack.data.indexed import IndexedDatasetWriter
from llmstack.errors import UserError
from llmstack.testing import run_distributed
from llmstack.training.evaluate import evaluate_perplexity, perplexity

SEQ_LEN = 16


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("valid") / "valid")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix) as writer:
        for n in (40, 25, 61, 9):
            writer.add_document(np.append(rng.integers(2, 320, n), 0))
    return prefix


def nll_by_hand(model, sequence):
    """Sum of -log p(token t | tokens before t) for t >= 1, one prefix at a time."""
    with torch.no_grad():
        return sum(
            -torch.log_softmax(model(input_ids=sequence[None, :t]).logits[0, -1].double(), -1)[sequence[t]].item()
            for t in range(1, len(sequence))
        )


def test_perplexity_is_exp_of_the_token_weighted_mean_loss():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, 320, (n,), generator=g) for n in (5, 12, 2)]
    batch = torch.randint(0, 320, (2, 7), generator=g)  # a batched block of 2 x (6 + 1) tokens
    result = evaluate_perplexity(model, [*documents, batch])
    sequences = [*documents, *batch]
    tokens = sum(len(s) - 1 for s in sequences)
    loss = sum(nll_by_hand(model, s) for s in sequences) / tokens
    assert result["tokens"] == tokens == 4 + 11 + 1 + 12
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert not model.training


def test_accuracy_is_the_share_of_targets_the_model_ranks_first():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    sequence = [int(torch.randint(0, 320, (1,), generator=g))]
    predicted = 0
    with torch.no_grad():
        for t in range(1, 30):  # every third token the model's own first choice, the others random
            first_choice = int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
            token = first_choice if t % 3 == 0 else int(torch.randint(0, 320, (1,), generator=g))
            predicted += token == first_choice
            sequence.append(token)
    result = evaluate_perplexity(model, [torch.tensor(sequence)])
    assert result["tokens"] == 29 and predicted >= 9
    assert result["accuracy"] == predicted / 29


def test_packed_blocks_score_seq_len_tokens_per_block(shard):
    model = tiny_model()
    blocks = PackedBlocks(shard, SEQ_LEN, shuffle=False)
    result = evaluate_perplexity(model, blocks.eval_batches(100, 3, 0, 1))
    assert result["tokens"] == blocks.num_blocks * SEQ_LEN == 8 * SEQ_LEN
    one_by_one = evaluate_perplexity(model, [torch.from_numpy(blocks.item(b)) for b in range(blocks.num_blocks)])
    assert result["loss"] == pytest.approx(one_by_one["loss"], rel=1e-6)
    assert evaluate_perplexity(model, blocks.eval_batches(100, 3, 0, 1), max_batches=2)["tokens"] == 6 * SEQ_LEN


def _evaluate_shard_share(rank, world_size, prefix):
    blocks = PackedBlocks(prefix, SEQ_LEN, shuffle=False)
    return evaluate_perplexity(tiny_model(), blocks.eval_batches(7, 2, rank, world_size), dp_group=dist.group.WORLD)


def test_data_parallel_shares_add_up_to_the_whole(shard):
    whole = evaluate_perplexity(tiny_model(), PackedBlocks(shard, SEQ_LEN, shuffle=False).eval_batches(7, 2, 0, 1))
    for rank_result in run_distributed(_evaluate_shard_share, world_size=2, args=(shard,)):
        assert rank_result["tokens"] == whole["tokens"] == 7 * SEQ_LEN
        assert rank_result["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_no_tokens_is_a_user_error():
    with pytest.raises(UserError, match="no tokens"):
        evaluate_perplexity(tiny_model(), [])


def test_the_loss_is_the_plain_nll_without_the_training_regularizers(shard):
    """Label smoothing and z-loss shape training only: the evaluation of a model configured with
    them equals that of the same weights without."""
    plain = evaluate_perplexity(tiny_model(), PackedBlocks(shard, SEQ_LEN, shuffle=False).eval_batches(4, 2, 0, 1))
    regularized = tiny_model(label_smoothing=0.1, z_loss=1e-3)
    blocks = PackedBlocks(shard, SEQ_LEN, shuffle=False).eval_batches(4, 2, 0, 1)
    assert evaluate_perplexity(regularized, blocks) == plain


def test_a_perplexity_beyond_float_range_is_infinite_not_clamped():
    assert perplexity(700.0) == pytest.approx(math.exp(700.0))
    assert perplexity(710.0) == math.inf
