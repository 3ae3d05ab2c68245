"""The fleet's replica table without processes: states, the loss bound, where a lost replica's work goes,
and a client that moves on from a lost replica. The real kills are in test_fleet.py and the trainer's e2e."""
import asyncio
from unittest import mock

import pytest

from megarl.rollout.client import GenerateClient
from megarl.rollout.replica_base import ReplicaLost
from megarl.rollout.replica_table import JOINING, LOST, SERVING, ReplicaFailuresExceeded, ReplicaTable, lost_cause
from megarl.rollout.sampling import Sampling


@pytest.fixture(autouse=True)
def no_ray_kill():
    with mock.patch("ray.kill") as kill:
        yield kill


def test_states_membership_and_admission(no_ray_kill):
    table = ReplicaTable(["h0", "h1", "h2"], max_failures=2)
    assert table.membership() == ((0, 0), (1, 0), (2, 0))
    table.mark_lost(table.replicas[1], "engine died")
    table.mark_lost(table.replicas[1], "engine died")  # reported twice: one loss
    no_ray_kill.assert_called_once_with("h1")
    assert [r.index for r in table.serving()] == [0, 2] and table.failures == 1
    assert table.membership() == ((0, 0), (2, 0))
    assert table.next_serving(table.replicas[1]).index == 2 and table.next_serving(table.replicas[2]).index == 0
    table.replaced(table.replicas[1], "h1'")
    assert table.replicas[1].state == JOINING and table.membership() == ((0, 0), (1, 1), (2, 0))
    assert [r.index for r in table.serving()] == [0, 2]  # not before a sync
    assert table.admit() == [1] and [r.state for r in table.replicas] == [SERVING] * 3
    assert table.replicas[1].handle == "h1'"


def test_losses_past_the_bound_stop_with_the_replica_and_its_log():
    table = ReplicaTable(["h0", "h1", "h2"], max_failures=1)
    table.mark_lost(table.replicas[0], "actor died")
    with pytest.raises(ReplicaFailuresExceeded, match=r"2 rollout replica losses, more than "
                       r"trainer.max_replica_failures=1 allows; the last: replica 2: oom.*rollout_replica2.log") as err:
        table.mark_lost(table.replicas[2], "oom")
    assert err.value.logs == ["rollout_replica2.log"]


def test_the_last_replica_lost_is_an_error_even_without_a_bound():
    table = ReplicaTable(["h0"], max_failures=None)
    with pytest.raises(RuntimeError, match="every rollout replica is lost; the last: replica 0: gone"):
        table.mark_lost(table.replicas[0], "gone")
    assert table.replicas[0].state == LOST


class Handle:
    """A replica actor's handle whose ``generate_tokens`` answers with its name, or fails as a lost replica."""

    def __init__(self, name: str, lost: bool = False):
        self.name, self.lost, self.calls = name, lost, 0
        self.generate_tokens = self

    def remote(self, *args):
        self.calls += 1

        async def answer():
            if self.lost:
                raise ReplicaLost(f"{self.name}: its vLLM engine died")
            return self.name
        return answer()


def test_a_client_moves_on_from_a_lost_replica_and_stays_there():
    handles = [Handle("r0"), Handle("r1", lost=True), Handle("r2")]
    client = GenerateClient([(0, handles[0]), (1, handles[1]), (2, handles[2])], 1, max_model_len=64, vocab_size=100)
    sampling = Sampling(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4)
    assert asyncio.run(client.generate([1, 2], sampling, seed=3)) == "r2" and client.replica == 2
    assert asyncio.run(client.generate([1, 2], sampling, seed=3)) == "r2" and handles[1].calls == 1
    only = GenerateClient([(1, handles[1])], 0, max_model_len=64, vocab_size=100)
    with pytest.raises(ReplicaLost):  # nowhere to go
        asyncio.run(only.generate([1, 2], sampling, seed=3))
    everyone_lost = GenerateClient([(1, handles[1]), (3, Handle("r3", lost=True))], 0, 64, 100)
    with pytest.raises(RuntimeError, match=r"every rollout replica this client knows \(\[1, 3\]\) is lost"):
        asyncio.run(everyone_lost.generate([1, 2], sampling, seed=3))


def test_lost_cause_is_one_line():
    assert lost_cause(RuntimeError("The actor died unexpectedly.\n\tdetails...")) == "The actor died unexpectedly."
