"""``tune_gc``: the collector's first threshold in megarl's processes, and its override."""
import gc

import pytest

from megarl.platform.gc_tuning import FIRST_THRESHOLD, tune_gc


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults
    yield
    gc.set_threshold(*saved)


def test_the_first_threshold_rises_and_the_older_generations_keep_theirs(thresholds, monkeypatch):
    monkeypatch.delenv("MEGARL_GC_THRESHOLD", raising=False)
    tune_gc()
    assert gc.get_threshold() == (FIRST_THRESHOLD, 10, 10) and FIRST_THRESHOLD > 700
    tune_gc()  # twice (a command that calls another's main) is the same
    assert gc.get_threshold() == (FIRST_THRESHOLD, 10, 10)


def test_the_environment_overrides_it_or_keeps_pythons(thresholds, monkeypatch):
    monkeypatch.setenv("MEGARL_GC_THRESHOLD", "2500")
    tune_gc()
    assert gc.get_threshold() == (2500, 10, 10)
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv("MEGARL_GC_THRESHOLD", "0")
    tune_gc()
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("value", ["ten thousand", "-5", "1e4"])
def test_a_bad_override_names_the_variable_and_changes_nothing(thresholds, monkeypatch, value):
    monkeypatch.setenv("MEGARL_GC_THRESHOLD", value)
    with pytest.raises(ValueError, match="MEGARL_GC_THRESHOLD"):
        tune_gc()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_run_s_ray_workers_tune_their_collector_and_get_the_driver_s_override(monkeypatch):
    """Every worker of the run's Ray job runs ``tune_gc`` first; a joined cluster's workers descend from
    ``ray start``, not from the driver, so the driver's override travels in the job's environment."""
    from megarl.cluster.ray_cluster import _job_runtime_env

    monkeypatch.delenv("MEGARL_GC_THRESHOLD", raising=False)
    assert _job_runtime_env({}) == {"worker_process_setup_hook": "megarl.platform.gc_tuning.tune_gc"}
    monkeypatch.setenv("MEGARL_GC_THRESHOLD", "2500")
    assert _job_runtime_env({"A": "1"})["env_vars"] == {"MEGARL_GC_THRESHOLD": "2500", "A": "1"}
    assert _job_runtime_env({"MEGARL_GC_THRESHOLD": "0"})["env_vars"] == {"MEGARL_GC_THRESHOLD": "0"}
