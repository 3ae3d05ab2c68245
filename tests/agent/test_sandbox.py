"""The Python code tool's sandbox against escape attempts. Each case is a real sandboxed process."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megarl.agent.tools.python_code import PythonCodeTool
from megarl.agent.tools.sandbox import SandboxLimits, check_available, run_python

pytestmark = pytest.mark.heavy  # every case is a sandboxed process
LIMITS = SandboxLimits(timeout_s=3, cpu_s=3, memory_mb=256, max_processes=16, scratch_mb=8, max_file_mb=4,
                       max_output_bytes=4096)
REPO_FILE = Path(__file__).resolve()


@pytest.fixture(scope="module", autouse=True)
def sandbox_available():
    check_available()  # a machine set up by scripts/setup_env.sh has bubblewrap: fail loudly if not


def python(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, limits))


def test_runs_code_and_returns_its_output():
    r = python("print(sum(range(10)))")
    assert (r.stdout, r.returncode, r.timed_out) == ("45\n", 0, False)
    r = python("raise ValueError('bad')")
    assert r.returncode == 1 and "ValueError: bad" in r.stderr


def test_cannot_read_the_host_files():
    r = python(f"""
import os
for path in ['/etc/passwd', '/etc/shadow', {str(REPO_FILE)!r}, '/root', '/home', '/work/main', '/sys']:
    try:
        open(path).read(1) if not os.path.isdir(path) else os.listdir(path)
        print('READ', path)
    except OSError as exc:
        print('denied', path, type(exc).__name__)
print(sorted(os.listdir('/')))
print(sorted(os.environ))
""")
    assert "READ" not in r.stdout, r.stdout
    assert "['bin', 'dev', 'lib', 'lib64', 'opt', 'proc', 'tmp', 'usr', 'work']" in r.stdout
    assert "['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE']" in r.stdout  # nothing from the host's environment
    assert os.path.exists(REPO_FILE)


def test_cannot_write_outside_its_scratch_and_the_scratch_is_bounded():
    r = python("""
for path in ['/usr/evil', '/opt/python/evil', '/evil', '/proc/evil']:
    try:
        open(path, 'w').write('x'); print('WROTE', path)
    except OSError as exc:
        print('denied', path)
open('/work/ok', 'w').write('fine'); print(open('/work/ok').read())
try:
    open('/work/big', 'wb').write(b'x' * (32 << 20)); print('WROTE big')
except OSError as exc:
    print('big refused', exc.errno)
""")
    assert "WROTE" not in r.stdout and "fine" in r.stdout and "big refused" in r.stdout, r.stdout + r.stderr


def test_has_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = python(f"""
import socket
for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:
    s = socket.socket(); s.settimeout(1)
    print(host, s.connect_ex((host, port)))
try:
    socket.getaddrinfo('example.com', 80); print('RESOLVED')
except OSError:
    print('no dns')
""")
    finally:
        server.close()
    lines = r.stdout.split("\n")
    assert all(line.split()[-1] != "0" for line in lines[:3]), r.stdout  # no connection anywhere
    assert "no dns" in r.stdout


def sandbox_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0].isdigit() and 60000 <= int(line.split()[0]) < 61000]


def test_timeout_kills_every_process_even_detached_ones():
    start = time.perf_counter()
    r = python("""
import os, time, subprocess
if os.fork() == 0:          # a double-forked, detached child trying to outlive the call
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
time.sleep(60)
""")
    assert r.timed_out and r.returncode is None and time.perf_counter() - start < 10
    time.sleep(0.5)
    assert sandbox_processes() == []


def test_fork_bomb_and_memory_and_output_are_bounded():
    r = python("import os\nwhile True:\n    os.fork()")
    assert not r.timed_out and "Resource temporarily unavailable" in r.stderr
    time.sleep(0.5)
    assert sandbox_processes() == []
    r = python("x = bytearray(1 << 30)")
    assert "MemoryError" in r.stderr
    r = python("print('y' * 100000)")
    assert r.output_truncated and len(r.stdout) <= LIMITS.max_output_bytes
    r = python("while True: pass", SandboxLimits(timeout_s=20, cpu_s=1))
    assert not r.timed_out and r.returncode != 0  # killed by the CPU limit (SIGXCPU), long before the timeout


# Processes that hold their memory at the same time, whatever the scheduler does: each makes its block resident,
# says so on one pipe and holds it until the parent closes the other (or dies); the parent waits for every
# process's word, or its death (an end-of-file), first. Without that, a loaded machine could run them one after
# another, each under the limit and the call never over it (two CI runs did).
HOLD_TOGETHER = """
import os
ready_r, ready_w = os.pipe()  # a byte from each process once its block is resident
go_r, go_w = os.pipe()        # closed by the parent (or by its death): the others let go


def resident(mb):
    block = bytearray(mb << 20)
    for j in range(0, len(block), 4096):
        block[j] = 1  # resident, not only reserved
    return block


def hold(block):
    os.write(ready_w, b"1")
    os.close(ready_w)
    os.read(go_r, 1)


def wait_for_the_others(count):
    arrived = b""
    while len(arrived) < count:
        more = os.read(ready_r, count)
        if not more:  # every other process has written or died
            break
        arrived += more
    os.close(go_w)
"""

THREE_CHILDREN_OF_120_MB = HOLD_TOGETHER + """
children = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        try:
            block = resident(120)
        except MemoryError:
            os._exit(3)
        hold(block)
        os._exit(0)
    children.append(pid)
os.close(ready_w)
wait_for_the_others(3)
print('held', sum(os.waitpid(pid, 0)[1] == 0 for pid in children))
"""

TWO_PROCESSES_OF_200_MB = HOLD_TOGETHER + """
pid = os.fork()
os.close(ready_w if pid else go_w)
block = resident(200)
if pid:
    wait_for_the_others(1)
    os.waitpid(pid, 0)
else:
    hold(block)
"""


def test_the_memory_limit_bounds_the_call_as_a_whole():
    """Three children of 120 MB each fit the per-process limit (256 MB) but not the call's: 360 MB > 256 MB."""
    from megarl.agent.tools.cgroup import memory_cgroups

    assert memory_cgroups() is not None, "this host gives root a writable memory cgroup (v1 here)"
    r = python(THREE_CHILDREN_OF_120_MB, SandboxLimits(timeout_s=20, memory_mb=256))
    held = int(r.stdout.split()[-1])
    assert held < 3 and r.memory_exceeded, (r.stdout, r.stderr)
    tool = PythonCodeTool({"timeout_s": 20, "memory_mb": 256})
    text = asyncio.run(tool.execute("i", {"code": TWO_PROCESSES_OF_200_MB}))[0].text
    assert "[killed: the program's processes together used more than 256 MB]" in text, text


def test_without_a_memory_cgroup_the_call_gets_fewer_processes_of_a_share_each(monkeypatch):
    import megarl.agent.tools.sandbox as sandbox

    monkeypatch.setattr(sandbox, "memory_cgroups", lambda: None)
    r = python(THREE_CHILDREN_OF_120_MB, SandboxLimits(timeout_s=20, memory_mb=512))
    assert r.stdout.split()[-1] == "0" and not r.memory_exceeded, (r.stdout, r.stderr)  # 128 MB of address space each
    r = python("import os\nfor i in range(8):\n    os.fork() or os._exit(0)", SandboxLimits(memory_mb=512))
    assert "Resource temporarily unavailable" in r.stderr  # at most 4 processes


def test_the_loopback_is_up_inside_and_reaches_nothing_outside():
    r = python("""
import socket
server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen(1)
client = socket.create_connection(server.getsockname(), timeout=2)
print('loopback', client.getsockname()[0])
""")
    assert r.stdout == "loopback 127.0.0.1\n", r.stderr


def test_the_tool_reports_what_happened():
    tool = PythonCodeTool({"timeout_s": 2, "memory_mb": 256})
    text = asyncio.run(tool.execute("i", {"code": "print(6 * 7)"}))[0].text
    assert text == "42"
    text = asyncio.run(tool.execute("i", {"code": "import time; time.sleep(10)"}))[0].text
    assert "[stopped: the program ran longer than 2 s]" in text
    text = asyncio.run(tool.execute("i", {"code": "1/0"}))[0].text
    assert "ZeroDivisionError" in text and "[exit status 1]" in text
    with pytest.raises(ValueError, match="unknown config keys"):
        PythonCodeTool({"memory": 1})
