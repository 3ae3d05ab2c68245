import io
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.logging import MetricsLogger, format_console_line


def test_tensorboard_jsonl_and_console(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(["console", "tensorboard", "jsonl"], tmp_path, stream=out)
    for step in (1, 2, 3):
        logger.log({"critic/score/mean": 0.1 * step, "actor/pg_loss": -step, "timing_s/gen": 1.5,
                    "note": "ignored text"}, step=step)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"critic/score/mean", "actor/pg_loss", "timing_s/gen"} <= set(acc.Tags()["scalars"])
    scores = [(e.step, round(e.value, 6)) for e in acc.Scalars("critic/score/mean")]
    assert scores == [(1, 0.1), (2, 0.2), (3, 0.3)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "note" not in rows[0]
    lines = out.getvalue().splitlines()
    assert lines[2].startswith("step 3 | score=0.3") and "gen=1.50" in lines[2]


def test_console_line_shows_reward_kl_and_times():
    line = format_console_line(7, {"critic/score/mean": 0.5, "actor/ppo_kl": 0.01, "timing_s/gen": 2.0,
                                   "timing_s/update_actor": 3.25})
    assert line == "step 7 | score=0.5 | ppo_kl=0.01 | time[s] gen=2.00 update_actor=3.25"


def test_the_step_line_ends_with_the_runs_progress(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(["console"], tmp_path, stream=out)
    logger.log({"critic/score/mean": 0.5}, step=3, progress="3/40 (8%), 0.25 steps/s, ETA 2m28s")
    logger.log({"critic/score/mean": 0.5}, step=4)
    assert out.getvalue().splitlines() == ["step 3 | score=0.5 | 3/40 (8%), 0.25 steps/s, ETA 2m28s", "step 4 | score=0.5"]


def test_unknown_logger_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown loggers"):
        MetricsLogger(["tensorbored"], tmp_path)


def test_nan_values_still_logged(tmp_path):
    logger = MetricsLogger(["jsonl"], tmp_path)
    logger.log({"actor/grad_norm": float("nan")}, step=1)
    logger.close()
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()


def test_validation_generations_go_to_console_tensorboard_text_and_jsonl(tmp_path):
    from megarl.trainer.controller import pick_generations

    prompts = [f"prompt {i}" for i in range(6)]
    picked = pick_generations(prompts, [f"answer {i}\nline" for i in range(6)], [str(i) for i in range(6)],
                              [float(i % 2) for i in range(6)], count=3)
    again = pick_generations(prompts[::-1], [f"answer {i}\nline" for i in range(6)][::-1], [str(i) for i in range(6)][::-1],
                             [float(i % 2) for i in range(6)][::-1], count=3)
    assert picked == again and len(picked) == 3  # the same samples whatever the order (sorted, then seed 42)
    assert set(picked[0]) == {"prompt", "response", "ground_truth", "score"}
    assert pick_generations(prompts, prompts, prompts, [0.0] * 6, count=0) == []

    out = io.StringIO()
    logger = MetricsLogger(["console", "tensorboard"], tmp_path, stream=out)
    logger.log_generations(picked, step=5)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 5, **sample} for sample in picked]
    printed = out.getvalue()
    assert "val/generations at step 5 (3 samples):" in printed and "answer" in printed and "\\nline" in printed
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 5 and all(sample["prompt"] in text for sample in picked)


def test_a_resumed_run_replaces_what_was_logged_after_its_checkpoint(tmp_path):
    """Interrupted after step 5 with its checkpoint at step 3: the resumed run logs steps 4 and 5 again;
    each step is then in TensorBoard and the JSONL files once, with the resumed run's values."""
    first = MetricsLogger(["tensorboard", "jsonl"], tmp_path)
    for step in range(1, 6):
        first.log({"actor/pg_loss": float(step)}, step=step)
        first.log_generations([{"prompt": "p", "response": f"first {step}"}], step=step)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as cut:
        cut.write('{"step": 6, "actor/pg')  # the interrupted run's last line, cut short
    resumed = MetricsLogger(["tensorboard", "jsonl"], tmp_path)
    resumed.rewind(3)
    for step in (4, 5):
        resumed.log({"actor/pg_loss": 10.0 * step}, step=step)
        resumed.log_generations([{"prompt": "p", "response": f"resumed {step}"}], step=step)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("actor/pg_loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["actor/pg_loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    samples = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [s["response"] for s in samples] == ["first 1", "first 2", "first 3", "resumed 4", "resumed 5"]
