"""Every schema key is read: by a rule of the checks (which refuses or bounds it) or by a settings
constructor at the door (``megarl.settings``), recorded while they run on a few configs that turn
the optional parts on (``megarl.devtools.key_readers``, which also gives the configuration reference
its "read by" column). There is no hand-kept index of readers: a key that nothing reads any more,
after a rename or a removed feature, fails here with its name.

A section handed to a component whole, typed (``typed_config``: the trainer's ``trainer`` and
``algorithm`` sections, the agent seam's ``rollout``), is read by that component: its keys count when
the field is used somewhere in the package (an attribute access of its name outside ``megarl/config``).
"""
from __future__ import annotations

from omegaconf import OmegaConf

from megarl.devtools.key_readers import INERT, leaf_keys, readers, recorded_reads, recording, unread


def test_every_schema_key_is_read_by_a_check_or_a_settings_constructor(tmp_path):
    direct, handed = recorded_reads(tmp_path)
    problems = unread(leaf_keys(), direct, handed)
    assert problems == [], "\n".join(problems)
    found = readers(direct, handed)  # what the configuration reference's "read by" column shows
    assert found["data.train_batch_size"][0] and "settings.trainer" in found["data.train_batch_size"][0]
    assert "settings.trainer" in found["trainer.save_freq"][1]  # the trainer section is handed on typed
    assert all(reads or typed for key, (reads, typed) in found.items() if key not in INERT)


def test_the_reader_check_fails_for_a_key_nobody_reads():
    """Controls: a key nobody reads, a typed key whose field no code uses; an inert key needs no reader."""
    keys = ["trainer.save_freq", "trainer.test_freq", "trainer.no_such_field", "trainer.nnodes", "a.inert_key"]
    problems = unread(keys, direct={"trainer.save_freq"}, handed={"trainer.no_such_field", "trainer.test_freq"},
                      inert={"a.inert_key": "why"})
    assert problems == ["trainer.no_such_field: no check and no settings constructor reads it",
                        "trainer.nnodes: no check and no settings constructor reads it"]
    with recording() as (direct, handed):
        cfg = OmegaConf.create({"a": {"b": 1, "c": {"d": 2}}, "e": 3})
        assert cfg.a.b == 1 and OmegaConf.to_container(cfg.a.c) == {"d": 2}
    assert set(direct) == {"a", "a.b", "a.c"} and not handed  # e and a.c.d were never read
    assert direct["a.b"] == {""}  # read by no megarl module: this test
