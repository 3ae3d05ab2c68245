"""start_together: the trainer ranks and the fleet start side by side; a failed start leaves nothing running."""
from __future__ import annotations

import threading

import pytest

from megarl.cluster.startup import start_together


class Started:
    def __init__(self, name: str):
        self.name, self.closed = name, False

    def shutdown(self) -> None:
        self.closed = True


def test_starters_run_at_the_same_time_and_return_by_name():
    fleet_running = threading.Event()

    def workers():  # finishes only once the fleet's starter is running: they must overlap
        assert fleet_running.wait(timeout=10), "the fleet did not start while the workers were starting"
        return Started("workers")

    def fleet():
        fleet_running.set()
        return Started("fleet")

    started = start_together(workers=workers, fleet=fleet)
    assert started["workers"].name == "workers" and started["fleet"].name == "fleet"


def test_a_failed_start_shuts_down_what_did_start_and_raises_its_error():
    workers = Started("workers")
    fleet_may_fail = threading.Event()

    def start_workers():
        fleet_may_fail.set()
        return workers

    def start_fleet():
        fleet_may_fail.wait(timeout=10)
        raise RuntimeError("rollout replica 0 failed to start its vLLM engine")

    with pytest.raises(RuntimeError, match="failed to start its vLLM engine"):
        start_together(workers=start_workers, fleet=start_fleet)
    assert workers.closed
