"""Which checkpoint a run resumes from (``megarl.trainer.resume``), on checkpoint directories written
here: files, ``megarl_checkpoint.json`` and the manifest, as a save leaves them (no process starts).

A ``latest`` naming an interrupted save, a truncated file, a critic step missing after a crash
between the two saves: each makes the run resume from the newest step that is whole, and says which
file made it pass the newer one over. Checkpoints that cannot be resumed are never started over.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megarl.engine import CheckpointIntegrityError, latest_checkpoint
from megarl.engine.checkpoint import META_FILE
from megarl.trainer.resume import ResumeError, load_first_whole, resume_plan
from tests.config._fixtures import write_saved_checkpoint as saved


def trainer(mode: str = "auto", path: Path | None = None):
    return OmegaConf.create({"resume_mode": mode, "resume_from_path": str(path) if path else None})


def test_latest_naming_an_interrupted_save_resumes_from_the_newest_whole_step(tmp_path):
    good = saved(tmp_path, "actor", 2)
    broken = saved(tmp_path, "actor", 4)
    (broken / META_FILE).unlink()  # what a save interrupted before its end would leave, were it renamed
    plan = resume_plan(trainer(), tmp_path)
    assert plan.first == (good, None)
    assert plan.notes == [f"checkpoint not usable: {broken}: no {META_FILE} (an interrupted or incomplete save); "
                          f"resuming from {good} instead"]
    with pytest.raises(FileNotFoundError) as raised:  # the conversion's reading of RUN/actor
        latest_checkpoint(tmp_path / "actor")
    assert f"the newest complete one is {good}: pass that directory" in str(raised.value)
    assert "remove" not in str(raised.value)


@pytest.mark.parametrize("name", ["__0_1.distcp", "common.pt", ".metadata", META_FILE])
def test_a_truncated_file_passes_the_step_over_naming_the_file(tmp_path, name):
    good = saved(tmp_path, "actor", 2)
    newest = saved(tmp_path, "actor", 4)
    size = (newest / name).stat().st_size
    os.truncate(newest / name, size // 2)
    plan = resume_plan(trainer(), tmp_path)
    assert plan.first == (good, None)
    assert f"{newest}: {name} has {size // 2} bytes, the manifest records {size} (truncated" in plan.notes[0]
    assert plan.notes[0].endswith(f"resuming from {good} instead")


def test_checkpoints_that_cannot_be_resumed_are_never_started_over(tmp_path):
    only = saved(tmp_path, "actor", 3)
    os.truncate(only / "__0_0.distcp", 10)
    with pytest.raises(ResumeError) as raised:
        resume_plan(trainer(), tmp_path)
    message = str(raised.value)
    assert f"trainer.default_local_dir={tmp_path} holds checkpoints (actor/step_3) but none can be resumed" in message
    assert "__0_0.distcp has 10 bytes" in message and "set trainer.resume_mode=disable to start over" in message
    plan = resume_plan(trainer("disable"), tmp_path)
    assert plan.first is None and plan.notes == [
        f"trainer.resume_mode=disable: starting over in {tmp_path}; its checkpoints (step_3) are replaced as this run saves"]
    assert resume_plan(trainer(), tmp_path / "fresh").first is None and resume_plan(trainer(), tmp_path / "fresh").notes == []


@pytest.mark.parametrize("left", ["nothing", "tmp"])
def test_ppo_resumes_from_the_newest_step_both_roles_have(tmp_path, left):
    """A crash between the actor's and the critic's saves of step 4 (the order before this fix)."""
    actor2, critic2 = saved(tmp_path, "actor", 2), saved(tmp_path, "critic", 2)
    actor4 = saved(tmp_path, "actor", 4)
    if left == "tmp":
        (tmp_path / "critic" / "step_4.tmp").mkdir()
    plan = resume_plan(trainer(), tmp_path, critic=True)
    assert plan.first == (actor2, critic2)
    reason = "its save was interrupted" if left == "tmp" else "the run stopped between the actor's and the critic's saves"
    assert f"{tmp_path / 'critic' / 'step_4'}" in plan.notes[0] and reason in plan.notes[0]
    assert resume_plan(trainer(), tmp_path, critic=False).first == (actor4, None)  # a run without a critic


def test_resume_path_must_be_usable_and_names_a_usable_one(tmp_path):
    good = saved(tmp_path, "actor", 2)
    bad = saved(tmp_path, "actor", 4)
    os.truncate(bad / "common.pt", 1)
    assert resume_plan(trainer("resume_path", good), tmp_path).first == (good, None)
    with pytest.raises(ResumeError, match=rf"resume_from_path={bad} cannot be resumed: .*common.pt has 1 bytes.*"
                                          rf"the newest usable one there is {good}"):
        resume_plan(trainer("resume_path", bad), tmp_path)
    with pytest.raises(FileNotFoundError, match="resume_from_path"):
        resume_plan(trainer("resume_path", tmp_path / "nowhere"), tmp_path)


class RayTaskErrorLike(CheckpointIntegrityError):
    """What ``ray.get`` raises for a worker's exception: an instance of its class too, whose text is the
    worker's traceback, with the original as ``cause``."""

    def __init__(self, cause):
        super().__init__("ray", ["Traceback (most recent call last): ..."])
        self.cause = cause


def test_a_checksum_failure_at_load_moves_to_the_previous_step(tmp_path, caplog):
    newest, older, oldest = (saved(tmp_path, "actor", s) for s in (6, 4, 2))
    tried = []

    def load(actor, critic):
        tried.append(actor.name)
        if actor == newest:
            raise RayTaskErrorLike(CheckpointIntegrityError(actor, ["__0_0.distcp has the recorded size but another sha256"]))
        return {"global_step": 4}

    candidates = resume_plan(trainer(), tmp_path).candidates
    with caplog.at_level(logging.INFO):
        assert load_first_whole(load, candidates) == ((older, None), {"global_step": 4})
    assert tried == ["step_6", "step_4"]
    assert (f"checkpoint {newest} is damaged: __0_0.distcp has the recorded size but another sha256; resuming "
            f"from {older} instead") in caplog.text

    def fails(actor, critic):
        raise RuntimeError("not a damaged checkpoint")

    with pytest.raises(RuntimeError, match="not a damaged checkpoint"):
        load_first_whole(fails, candidates)

    def all_damaged(actor, critic):
        raise CheckpointIntegrityError(actor, ["common.pt is missing"])

    with pytest.raises(ResumeError, match=f"checkpoint {oldest} is damaged: common.pt is missing; no older usable"):
        load_first_whole(all_damaged, candidates)


def test_the_interrupt_report_names_the_step_a_resume_would_use(tmp_path):
    from megarl.run.interrupts import latest_checkpoint_step

    good = saved(tmp_path, "actor", 2)
    (saved(tmp_path, "actor", 4) / META_FILE).unlink()  # latest names it
    assert latest_checkpoint_step(tmp_path) == (2, good)
