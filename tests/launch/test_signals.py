"""slurm/signals.sh without Slurm: the batch shell forwards Slurm's warning (SIGUSR1) to a driver running
under it, returns the driver's own exit code, and requeues only after a forwarded warning (``scontrol`` is
a shell function here that prints its command). The whole path on the local Slurm cluster:
tests/launch/test_slurm_e2e.py."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = '''
import signal, sys, time
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(s))
open(sys.argv[1], "w").write("ready")
deadline = time.monotonic() + float(sys.argv[2])
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.5)  # the step in progress ends, then its checkpoint
print("driver stopped for", signal.Signals(got[0]).name if got else "nothing", flush=True)
sys.exit(128 + got[0] if got else 0)
'''
SHELL = '''
source "$1/slurm/signals.sh"
scontrol() { echo "scontrol $*"; }
run_forwarding_signals python3 -c "$2" "$3" "$4"
echo "rc=$DRIVER_RC forwarded=$FORWARDED"
requeue_if_preempted
'''


def batch_shell(tmp_path: Path, sig: int | None) -> str:
    ready = tmp_path / f"ready{sig}"
    proc = subprocess.Popen(["bash", "-c", SHELL, "batch", str(REPO), DRIVER, str(ready),
                             "20" if sig is not None else "0.5"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "SLURM_JOB_ID": "77"})
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    if sig is not None:
        proc.send_signal(sig)  # to the batch shell only, as --signal=B:USR1 does
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


@pytest.mark.heavy  # the batch shell and a driver in subprocesses
@pytest.mark.parametrize("sig,expected", [
    (signal.SIGUSR1, "driver stopped for SIGUSR1\nrc=138 forwarded=USR1\n"),
    (signal.SIGTERM, "driver stopped for SIGTERM\nrc=143 forwarded=TERM\n"),  # scancel's: no requeue here
    (None, "driver stopped for nothing\nrc=0 forwarded=\n")])
def test_the_batch_shell_forwards_the_warning_and_requeues_after_it(tmp_path, sig, expected):
    out = batch_shell(tmp_path, sig)
    assert out.startswith(expected), out
    requeued = "scontrol requeue 77" in out
    assert requeued == (sig == signal.SIGUSR1), out


def test_every_sbatch_launcher_asks_for_the_warning_and_may_be_requeued():
    for script in sorted((REPO / "launch").glob("*.sh")):
        text = script.read_text()
        if "#SBATCH" not in text:
            continue  # ray_local.sh
        assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@" in text, script
        assert "#SBATCH --open-mode=append" in text, script  # a requeued job's output follows the first one's
