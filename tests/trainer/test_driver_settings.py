"""Driver-side keys, without processes: the tokenizer's options, hub ids, validation-only runs."""
from __future__ import annotations

from types import SimpleNamespace

from megarl.checks import load_config
from tests.config._fixtures import write_model_config

BASE = ["data.train_files=/d/train.parquet", "data.val_files=/d/val.parquet", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.resume_mode=disable"]


def test_tokenizer_takes_data_trust_remote_code_and_the_custom_chat_template(monkeypatch):
    import transformers

    from megarl.settings.data import load_tokenizer

    calls = []

    def fake_from_pretrained(path, **kwargs):
        calls.append((path, kwargs))
        return SimpleNamespace(chat_template="{{ original }}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    cfg = load_config(None, [*BASE, "actor_rollout_ref.model.path=/m", "data.trust_remote_code=True",
                             "actor_rollout_ref.model.custom_chat_template='{{ mine }}'"])
    tokenizer = load_tokenizer(cfg)
    assert calls == [("/m", {"trust_remote_code": True})] and tokenizer.chat_template == "{{ mine }}"
    cfg = load_config(None, [*BASE, "actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.tokenizer_path=/t"])
    assert load_tokenizer(cfg).chat_template == "{{ original }}" and calls[-1] == ("/t", {"trust_remote_code": False})


def test_hub_ids_become_the_cache_snapshot_before_anything_starts(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    from megarl.run.train import local_model_paths

    snapshot = write_model_config(tmp_path / "hub" / "models--acme--m" / "snapshots" / ("1" * 40))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = load_config(None, [*BASE, "actor_rollout_ref.model.path=acme/m"])
    local_model_paths(cfg)
    assert cfg.actor_rollout_ref.model.path == str(snapshot)


class _Logger:
    def __init__(self):
        self.logged, self.generations = [], []

    def log(self, metrics, step, console=True, progress=None):
        self.logged.append((step, dict(metrics)))

    def log_generations(self, samples, step):
        self.generations.append((step, list(samples)))


class _Trainer:
    def __init__(self, cfg):
        from megarl.settings.trainer import trainer_settings

        self.settings, self.val_dataset, self.history, self.total_steps = trainer_settings(cfg), ["a prompt"], [], 3
        self.val_generations = [{"prompt": "p", "response": "r", "ground_truth": "g", "score": 1.0}]
        self.steps = []

    def validate(self):
        return {"val/score": 0.5}

    def train_step(self, step):
        self.steps.append(step)
        return {}


def test_val_only_validates_once_and_does_not_train(tmp_path):
    from megarl.run.loop import TrainingLoop

    cfg = load_config(None, [*BASE, "actor_rollout_ref.model.path=/m", "trainer.val_only=True",
                             "trainer.val_before_train=False"])
    trainer, logger = _Trainer(cfg), _Logger()
    assert TrainingLoop(trainer, logger, str(tmp_path)).run() == {"val/score": 0.5}
    assert trainer.steps == [] and logger.logged == [(0, {"val/score": 0.5})]
    assert logger.generations == [(0, trainer.val_generations)]  # the samples go with every validation
    cfg = load_config(None, [*BASE, "actor_rollout_ref.model.path=/m", "trainer.test_freq=2"])
    trainer, logger = _Trainer(cfg), _Logger()
    TrainingLoop(trainer, logger, str(tmp_path)).run()
    assert trainer.steps == [1, 2, 3] and [step for step, _ in logger.generations] == [0, 2, 3]
