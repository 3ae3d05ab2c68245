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


def test_unknown_logger_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown loggers"):
        MetricsLogger(["tensorbored"], tmp_path)


def test_nan_values_still_logged(tmp_path):
    logger = MetricsLogger(["jsonl"], tmp_path)
    logger.log({"actor/grad_norm": float("nan")}, step=1)
    logger.close()
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()
