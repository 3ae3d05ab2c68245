"""Where the run's own listening sockets bind: the cluster address, never every interface.

A torch ``TCPStore`` server (the torch.distributed rendezvous of the trainer ranks, the weight-sync
store) answers anyone who connects: it has no authentication. Created the usual way it listens on
every interface (``::``, dual stack, measured), so a run on a machine with an external address
offered both stores there. TCPStore has no bind-address argument, but it takes a socket that is
already listening (``master_listen_fd``, which works with torch 2.13's default libuv backend), so
the host of a store makes that socket here, bound to the address its clients are given: 127.0.0.1
on one node (Ray runs there, and every address of the run is 127.0.0.1), the node's cluster address
(the one MASTER_ADDR names, Ray's node address) on several.

gloo and NCCL open listening sockets of their own, for every process group, on the interface
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` names (else gloo takes the address the hostname
resolves to, which can be any interface). ``pin_socket_interfaces`` sets both to the interface that
holds the address this process uses towards the cluster (``lo`` on one node), unless the user set
them; the trainer ranks call it before torch.distributed starts, the rollout replicas before vLLM
starts (its TP workers and the weight-sync receivers inherit the environment).

    port = reserve_port("127.0.0.1")                 # the host picks and holds a port
    store = tcp_store("127.0.0.1", port, world_size=3, is_master=True, timeout_s=60)
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from datetime import timedelta

logger = logging.getLogger(__name__)

SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_reserved: dict[tuple[str, int], socket.socket] = {}  # listening sockets reserve_port holds until tcp_store takes them
_lock = threading.Lock()


def resolve(host: str) -> str:
    """The IP address ``host`` names (IPv4 preferred); an address is returned as it is."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror:
            continue
    raise ValueError(f"cannot resolve the host name {host!r} to an address")


def local_addresses() -> dict[str, str]:
    """Every IP address of this machine's interfaces -> the interface's name."""
    import psutil

    found = {}
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                found.setdefault(address.address.split("%")[0], name)
    return found


def address_towards(host: str) -> str:
    """This machine's address on the way to ``host``: ``host``'s own address when this machine has
    it, else the source address the kernel would route from (a UDP ``connect`` sends nothing)."""
    address = resolve(host)
    if address in local_addresses():
        return address
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (``lo`` for 127.0.0.1), or None."""
    return local_addresses().get(resolve(address))


def pin_socket_interfaces(cluster_host: str) -> dict[str, str]:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (those the user has not set) to the
    interface this process reaches ``cluster_host`` through; return what was set."""
    interface = interface_of(address_towards(cluster_host))
    if interface is None:
        logger.warning("no interface of this machine holds its address towards %s; gloo and NCCL pick their own",
                       cluster_host)
        return {}
    chosen = {name: interface for name in SOCKET_INTERFACE_VARIABLES if not os.environ.get(name)}
    os.environ.update(chosen)
    return chosen


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host``'s address (never every interface) and listening."""
    address = resolve(host)
    if ipaddress.ip_address(address).is_unspecified:
        raise ValueError(f"refusing to listen on {address} (every interface): give the cluster address")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {address}:{port} ({host}): {exc.strerror}; the store's host "
                                 f"must run on the machine that holds this address") from exc
    return sock


def reserve_port(host: str) -> int:
    """Listen on a free port of ``host``'s address now and hold it for ``tcp_store(host, port, is_master=True)``
    (no other process can take the port in between)."""
    sock = listening_socket(host)
    port = sock.getsockname()[1]
    with _lock:
        _reserved[(resolve(host), port)] = sock
    return port


def release_port(host: str, port: int) -> None:
    """Close a reserved port that no store will take (a start that failed)."""
    with _lock:
        sock = _reserved.pop((resolve(host), port), None)
    if sock is not None:
        sock.close()


def tcp_store(host: str, port: int, world_size: int | None, is_master: bool, timeout_s: float,
              wait_for_workers: bool = False):
    """A ``torch.distributed.TCPStore``: the host's server listens on ``host``'s address only (a port
    ``reserve_port`` holds, or ``port``), the others connect to ``host:port``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, int(port), world_size, False, timeout, wait_for_workers=False)
    with _lock:
        sock = _reserved.pop((resolve(host), int(port)), None)
    sock = sock or listening_socket(host, int(port))
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on (and closes it)
    try:
        return dist.TCPStore(host, bound_port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
