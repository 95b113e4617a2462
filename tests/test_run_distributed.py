"""The multi-process harness every distributed test uses: results in rank order, and a launch whose
rendezvous port another process took in the meantime is retried on another port."""

import socket

import llmstack.testing as testing
from llmstack.net import free_port


def rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def test_a_taken_rendezvous_port_is_retried_on_another(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, as another process's server would hold it
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(testing, "free_port", lambda: next(ports, None) or free_port())
    try:
        assert testing.run_distributed(rank_and_size, 2) == [(0, 2), (1, 2)]
    finally:
        taken.close()
