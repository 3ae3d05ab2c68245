"""The run's stores listen on the cluster address only, never on every interface.

The address checks run in a network namespace of the test's own (``unshare --net``, root), where
loopback also holds a second, non-loopback address (10.77.0.1): a store listening on every
interface answers there, one bound to 127.0.0.1 refuses. The gloo check also gives the namespace a
host name that resolves to 10.77.0.1 (its own /etc/hosts, bind-mounted in a private mount
namespace), as on a machine whose name resolves to its external address: gloo, left alone, listens
there. Outside such a namespace the tests assert the bound address of the listening socket. No
packet leaves this machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from megarl.platform import network

REPO = Path(__file__).resolve().parents[2]
OTHER_ADDRESS = "10.77.0.1"  # exists only inside the test's own network namespace

# The weight-sync store's host (megarl.weight_sync.transport.base.rendezvous) and the trainer ranks'
# torch.distributed rendezvous (megarl.platform.init_distributed, rank 0 of 2) in one process.
PROBE = textwrap.dedent(f'''
    import os, socket, sys, threading
    import torch.distributed as dist
    from megarl.platform import init_distributed, network
    from megarl.weight_sync.transport.base import rendezvous

    def answers(address, port):
        with socket.socket() as sock:
            sock.settimeout(5)
            return sock.connect_ex((address, port)) == 0

    def serve_rendezvous(port):
        os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_distributed(timeout_s=60)

    store_port = network.reserve_port("127.0.0.1")
    store = rendezvous(0, 2, "127.0.0.1", store_port, timeout_s=60)
    dist_port = network.reserve_port("127.0.0.1")
    network.release_port("127.0.0.1", dist_port)  # init_distributed binds the port itself
    host = threading.Thread(target=serve_rendezvous, args=(dist_port,), daemon=True)
    host.start()
    rank1 = network.tcp_store("127.0.0.1", dist_port, 2, False, 60)  # wait until the rendezvous listens
    for name, port in (("weight-sync store", store_port), ("rendezvous store", dist_port)):
        print(name, "loopback", answers("127.0.0.1", port), "other", answers("{OTHER_ADDRESS}", port), flush=True)
    os._exit(0)
''')


# Two ranks of megarl.platform.init_distributed (MASTER_ADDR=127.0.0.1) and one all-reduce over gloo; each
# prints the addresses it listens on.
GLOO_PROBE = textwrap.dedent('''
    import os, socket
    import psutil, torch, torch.distributed as dist, torch.multiprocessing as mp
    from megarl.platform import init_distributed

    def rank(r, port):
        os.environ.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_distributed(timeout_s=60)
        dist.all_reduce(torch.ones(1))
        ips = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"})
        for turn in range(2):  # one rank at a time: two ranks printing at once interleave their lines
            if turn == r:
                print("rank", r, socket.gethostbyname(socket.gethostname()), ips, flush=True)
            dist.barrier()

    if __name__ == "__main__":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(rank, args=(port,), nprocs=2)
''')


def in_own_namespace(script: str, workdir: Path, own_hostname: bool = False) -> subprocess.CompletedProcess | None:
    """Run ``script`` in a fresh network namespace whose lo also holds OTHER_ADDRESS (and, with ``own_hostname``,
    whose host name ``megarl-node`` resolves to it); None if not allowed here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    (workdir / "probe.py").write_text(script)
    setup = f"ip link set lo up && ip addr add {OTHER_ADDRESS}/32 dev lo"
    flags = ["--net"]
    if own_hostname:
        (workdir / "hosts").write_text(f"127.0.0.1 localhost\n{OTHER_ADDRESS} megarl-node\n")
        setup += f" && hostname megarl-node && mount --bind {workdir / 'hosts'} /etc/hosts"
        flags += ["--uts", "--mount"]
    setup += f" && exec {sys.executable} {workdir / 'probe.py'}"
    result = subprocess.run(["unshare", *flags, "sh", "-c", setup], capture_output=True, text=True,
                            timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode != 0 and "unshare" in result.stderr and "Operation not permitted" in result.stderr:
        return None
    return result


@pytest.mark.heavy  # starts a process
def test_stores_refuse_connections_on_other_addresses(tmp_path):
    result = in_own_namespace(PROBE, tmp_path)
    if result is None:
        pytest.skip("no network namespace here (needs root and unshare); the bound address is checked below")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if " loopback " in line]
    assert lines == ["weight-sync store loopback True other False", "rendezvous store loopback True other False"], \
        result.stdout + result.stderr


@pytest.mark.heavy  # starts a process
def test_gloo_listens_on_the_cluster_interface_not_the_host_names_address(tmp_path):
    result = in_own_namespace(GLOO_PROBE, tmp_path, own_hostname=True)
    if result is None:
        pytest.skip("no network namespace here (needs root and unshare)")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    # the host name resolves to 10.77.0.1, yet the store and gloo's pairs listen on 127.0.0.1 only
    assert lines == [f"rank 0 {OTHER_ADDRESS} ['127.0.0.1']", f"rank 1 {OTHER_ADDRESS} ['127.0.0.1']"], \
        result.stdout + result.stderr


def listening_on(process: psutil.Process, port: int) -> set[str]:
    """The addresses ``process`` listens on at ``port`` (other tests of this process may hold other sockets)."""
    return {c.laddr.ip for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_store_host_binds_the_given_address():
    port = network.reserve_port("127.0.0.1")
    store = network.tcp_store("127.0.0.1", port, 2, True, timeout_s=30)
    client = network.tcp_store("127.0.0.1", port, 2, False, timeout_s=30)
    client.set("key", "value")
    assert store.get("key") == b"value"
    assert listening_on(psutil.Process(), port) == {"127.0.0.1"}
    del store, client
    assert listening_on(psutil.Process(), port) == set()  # the store owned the socket and closed it


def test_every_interface_is_refused():
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        network.listening_socket("0.0.0.0")
    with pytest.raises(OSError, match="cannot listen on 192.0.2.254"):  # an address this machine does not hold
        network.listening_socket("192.0.2.254")


def test_gloo_and_nccl_interfaces_are_pinned_unless_set(monkeypatch):
    for name in network.SOCKET_INTERFACE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.pin_socket_interfaces("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert network.pin_socket_interfaces("localhost") == {"NCCL_SOCKET_IFNAME": "lo"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"  # the user's choice stands
