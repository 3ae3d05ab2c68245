"""A real run's processes and sockets: ``megarl train`` in a subprocess, on a tiny model, three launches.

1. Every socket the run's processes listen on is on the loopback address (Ray, vLLM, gloo, the
   torch.distributed rendezvous and the weight-sync store); then the driver is SIGKILLed: every
   process of the run is gone within 20 s and so is its Ray temp dir (the reaper). Where the test
   may (root, ``unshare``), this run has a network namespace of its own whose host name resolves to
   a second, non-loopback address (10.77.0.1), as on a machine whose name is its external address:
   gloo and the stores, left alone, listen there or on every interface; ``ss`` in that namespace
   lists every socket of the run. No packet leaves this machine.
2. A run whose driver and reaper are both SIGKILLed while it starts leaves a temp dir (and Ray's
   agents, for a minute): the next run removes both before its own cluster starts.
3. That next run saves a checkpoint every step; its Megatron rank is killed while megatron's
   checkpoint writers (forks of the rank) run: the driver fails within 60 s naming the dead rank
   (it hung 460 s before), and the writers die with the rank.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megarl.cluster import run_reaper

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
OTHER_ADDRESS = "10.77.0.1"  # exists only inside the first run's own network namespace


def namespaces_allowed() -> bool:
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("unshare", "nsenter", "ss")):
        return False
    return subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from megarl.data.prepare import prepare_arithmetic
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("processes")
    model = make_tiny_model("llama", "tiny", root / "model", seed=0)
    prepare_arithmetic(root / "data", num_train=64, num_test=8, seed=0, max_operand=8, ops=["+"], second_operand=1)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    (root / "hosts").write_text(f"127.0.0.1 localhost\n{OTHER_ADDRESS} megarl-node\n")

    def start(name: str, *extra: str, own_network: bool = False) -> "Run":
        command = [sys.executable, "-m", "megarl.run.train", "--config-name", "quickstart",
                   f"data.train_files={root / 'data' / 'train.parquet'}",
                   f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", f"actor_rollout_ref.model.path={model}",
                   "trainer.total_training_steps=200", "trainer.test_freq=-1", "trainer.val_before_train=false",
                   f"trainer.default_local_dir={root / name}", *extra]
        if own_network:
            setup = (f"ip link set lo up && ip addr add {OTHER_ADDRESS}/32 dev lo && hostname megarl-node && "
                     f"mount --bind {root / 'hosts'} /etc/hosts && exec {shlex.join(command)}")
            command = ["unshare", "--net", "--uts", "--mount", "sh", "-c", setup]
        return Run(subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1, start_new_session=True), root / name, own_network)

    return start


class Run:
    """A launched run: its output lines (read in a thread), its processes, its Ray temp dir."""

    def __init__(self, proc: subprocess.Popen, out: Path, own_network: bool):
        self.proc, self.out, self.lines, self.own_network = proc, out, [], own_network
        threading.Thread(target=lambda: self.lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True).start()

    def wait_for(self, pattern: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(re.search(pattern, line) for line in list(self.lines)):
            assert self.proc.poll() is None, f"the run ended before {pattern!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no line matching {pattern!r} within {timeout_s} s:\n{self.output()}"
            time.sleep(0.2)

    def output(self) -> str:
        return "\n".join(self.lines)

    def processes(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def ray_temp_dir(self) -> Path:
        return Path(re.findall(r"temp dir (/\S+)\)", (self.out / "logs" / "driver.log").read_text())[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def command_line(process: psutil.Process) -> str:
    """The process's command line, or "" once it has ended: a process listed a moment ago may be gone, or a
    zombie its parent has not reaped yet (a short-lived helper of Ray's), by the time it is read."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def running(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def listening(run: Run) -> list[tuple[str, str, int]]:
    """(process, address, port) of every listening TCP socket of the run: from ``ss`` in the run's own network
    namespace (every socket there is the run's), else from its processes."""
    if run.own_network:
        table = subprocess.run(["nsenter", "--target", str(run.proc.pid), "--net", "ss", "-ltnpH"], check=True,
                               capture_output=True, text=True).stdout
        found = []
        for line in table.splitlines():
            local, process = line.split()[3], (re.findall(r'\(\("([^"]+)"', line) or ["?"])[0]
            address, port = local.rsplit(":", 1)
            found.append((process, address.strip("[]"), int(port)))
        return found
    found = []
    for process in [psutil.Process(run.proc.pid)] + run.processes():
        try:
            found += [(process.name(), c.laddr.ip, c.laddr.port)
                      for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def is_loopback(ip: str) -> bool:
    if ip == "*":
        return False
    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


@pytest.mark.timeout(900)
def test_sockets_a_killed_driver_a_stale_run_and_a_rank_killed_while_saving(launch):
    sockets_then_killed_driver(launch("a", "trainer.save_freq=-1", own_network=namespaces_allowed()))
    stale, left_behind = driver_and_reaper_killed(launch("b", "trainer.save_freq=-1"))
    cleaned_then_rank_killed_while_saving(launch("c", "trainer.save_freq=1"), stale, left_behind)


def sockets_then_killed_driver(run: Run) -> None:
    """1. Every listening socket on loopback; the driver SIGKILLed takes every process and the temp dir."""
    try:
        run.wait_for(r"^step 2 \|", timeout_s=420)
        processes = run.processes()
        sockets = listening(run)
        print(f"own network namespace: {run.own_network}\n" +
              "\n".join(f"LISTEN {name} {ip}:{port}" for name, ip, port in sorted(sockets)))
        trainer_rank = [s for s in sockets if s[0].startswith("ray::MegatronWo")]
        assert len(trainer_rank) >= 3, sockets  # the rendezvous store, the weight-sync store, gloo's pairs
        # the engine worker's gloo groups (vLLM's, the weight sync's): in the replica's process on CPU at TP=1,
        # in vLLM's own worker process otherwise; Ray's servers there listen on IPv4-mapped IPv6 addresses
        engine = ("ray::EngineRepl", "VLLM::")
        assert [s for s in sockets if s[0].startswith(engine) and s[1] == "127.0.0.1"], sockets
        assert [s for s in sockets if not is_loopback(s[1])] == [], "listening beyond the loopback address"
        temp_dir = run.ray_temp_dir()
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        began = time.monotonic()
        left = running(processes, timeout_s=20)
        assert not left, f"left running 20 s after the driver was killed: {[(p.pid, p.name()) for p in left]}"
        print(f"every process of the run gone {time.monotonic() - began:.1f} s after the driver's SIGKILL")
        assert not temp_dir.exists(), f"Ray's temp dir {temp_dir} is left"
    finally:
        run.stop()


def driver_and_reaper_killed(run: Run) -> tuple[Path, list[psutil.Process]]:
    """2. Driver and reaper SIGKILLed while the engines start: the temp dir (and Ray's agents) stay behind."""
    try:
        run.wait_for(r"^Ray cluster: ", timeout_s=300)
        stale = run.ray_temp_dir()
        deadline = time.time() + 60  # the reaper records the cluster's processes every second, once it runs
        while not run_reaper.read_record(stale) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # two more records: the agents Ray starts after the head
        processes = run.processes()
        reaper = [p for p in processes if "megarl.cluster.run_reaper" in command_line(p)]
        assert len(reaper) == 1, [command_line(p) for p in processes]
        for process in (psutil.Process(run.proc.pid), reaper[0]):
            process.kill()
        run.proc.wait()
    finally:
        run.stop()
    assert stale.exists()
    return stale, processes


def cleaned_then_rank_killed_while_saving(run: Run, stale: Path, left_behind: list[psutil.Process]) -> None:
    """3. The next run removes what the dead one left, first; its rank is killed while megatron's writers run."""
    try:
        run.wait_for(r"^Ray cluster: ", timeout_s=300)
        assert not stale.exists(), (f"the dead run's temp dir {stale} is left, holding "
                                    f"{sorted(str(p.relative_to(stale)) for p in stale.rglob('*'))[:20]}:\n"
                                    f"{run.output()[-3000:]}")
        left = running(left_behind, timeout_s=0)
        assert not left, f"the dead run's processes are left: {[(p.pid, p.name()) for p in left]}"
        run.wait_for(r"^checkpoint step 1: ", timeout_s=420)
        rank = next(p for p in run.processes() if p.name().startswith("ray::MegatronWo"))
        writers = forked_writers(rank, timeout_s=120)
        rank.kill()
        killed = time.monotonic()
        rc = run.proc.wait(timeout=120)
        seconds = time.monotonic() - killed
        output = run.output()
        print(f"the driver failed {seconds:.1f} s after the rank was killed\n{output[-3000:]}")
        assert rc != 0 and seconds < 60, output
        assert re.search(rf"trainer rank 0 \(pid {rank.pid} on 127\.0\.0\.1\) died while running save_checkpoint "
                         r"\(step \d+\)", output), output
        assert not running(writers, timeout_s=10), "megatron's writers outlived the rank"
        assert not run.ray_temp_dir().exists()
    finally:
        run.stop()


def forked_writers(rank: psutil.Process, timeout_s: float) -> list[psutil.Process]:
    """Megatron's checkpoint writers of the next save: forks of the rank (they carry its name), alive now."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            forks = [p for p in rank.children() if p.name().startswith("ray::MegatronWo")]
        except psutil.Error:
            forks = []
        if forks:
            return forks
        time.sleep(0.005)
    pytest.fail(f"no checkpoint writer of rank pid {rank.pid} seen within {timeout_s} s")
