"""Reading ahead: the same batches in the same order, errors reach the consumer, and a streaming
mixture's saved position is the consumed one, however far the reader ran ahead."""

import json
import threading

import pytest
import torch
from test_data_stream import corpus, stream, take  # noqa: F401  (corpus is a fixture)

from llmstack.data.prefetch import Prefetcher


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_arrive_in_order_and_the_end_stops_iteration(depth):
    assert list(Prefetcher(iter(range(10)), depth=depth)) == list(range(10))


def test_an_error_in_the_reader_is_raised_by_next():
    def failing():
        yield 1
        raise OSError("disk gone")

    batches = Prefetcher(failing(), depth=2)
    assert next(batches) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(batches)


def test_close_stops_a_reader_blocked_on_a_full_queue():
    def endless():
        n = 0
        while True:
            yield n
            n += 1

    batches = Prefetcher(endless(), depth=2)
    assert next(batches) == 0
    batches.close()
    assert not any(t.name == "llmstack-prefetch" and t.is_alive() for t in threading.enumerate())


def test_a_prefetched_stream_saves_the_consumed_position(corpus):  # noqa: F811
    micro, dp_size, rank = 2, 2, 1
    plain = stream(corpus)
    expected = take(plain.micro_batches(0, micro, rank, dp_size), 5)
    ahead = stream(corpus)
    batches = Prefetcher(ahead.micro_batches(0, micro, rank, dp_size), depth=4, snapshot=ahead.state_dict)
    got = take(batches, 5)
    while batches._queue.qsize() < 4:  # the reader runs 4 batches ahead, then waits
        threading.Event().wait(0.01)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    saved = json.loads(json.dumps(batches.state_dict()))
    assert saved["position"] == 5 * micro and saved == json.loads(json.dumps(plain.state_dict()))
    # The reader is 4 batches queued and 1 in hand ahead of what training took.
    assert json.loads(json.dumps(ahead.state_dict()))["position"] == 10 * micro
    batches.close()
