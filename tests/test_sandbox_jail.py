"""The Python tool's jail, tried as an attacker would: each case is model code that tries to read the
trainer's secrets or files, harm the trainer's process, write outside its folder, reach the network,
exhaust the machine or outlive its call, run through the tool as the agent loop runs it. After each,
the host is checked, not only the call's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fulcrum.agent import FunctionCall, ToolCallResult, ToolSet
from fulcrum.agent.python_tool import PythonTool

SECRET = "jail-test-s3cr3t"


def run_code(code: str, **config: Any) -> ToolCallResult:
    """One call of the Python tool as the agent loop makes it; the response is not cut."""
    tool = PythonTool({"default_timeout": 10, "memory_limit_mb": 512, **config}, None)
    toolset = ToolSet([tool], max_tool_response_length=1_000_000)
    call = FunctionCall("code_interpreter", json.dumps({"code": textwrap.dedent(code)}))
    (result,) = asyncio.run(toolset.run_turn([call]))
    return result


def text(code: str, **config: Any) -> str:
    return run_code(code, **config).response.text or ""


def errors(result: ToolCallResult) -> set[str]:
    prefix = "tools/errors/"
    return {k[len(prefix) :] for k, v in result.metrics.items() if k.startswith(prefix) and v}


@pytest.fixture(autouse=True)
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", SECRET)


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process of the trainer's user that the code tries to signal."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def call_processes(token: str) -> list[int]:
    """Host processes whose command line holds `token` (left over from a call)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline:
                found.append(int(entry))
    return found


def test_subprocess_fork_exec_runs_only_inside_the_jail(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    code = f"""
        import subprocess, os
        r, w = os.pipe()
        subprocess._fork_exec([b'/bin/sh', b'-c', b'env > {out}; head -c 40 /etc/shadow >> {out}; env; id -u'],
            [b'/bin/sh'], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None,
            -1, None, True)
        import time; time.sleep(1)
        """
    said = text(code)
    assert not out.exists()
    assert SECRET not in said


def test_the_trainers_environment_and_proc_entries_are_out_of_sight() -> None:
    me = os.getpid()
    said = text(
        f"""
        import os
        print(sorted(os.environ))
        for pid in (os.getppid(), {me}, 1):
            for name in ('environ', 'cmdline', 'status'):
                try:
                    print(pid, name, open(f'/proc/{{pid}}/{{name}}', 'rb').read()[:300])
                except OSError as e:
                    print(pid, name, 'no:', e.strerror)
        print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
        """
    )
    assert SECRET not in said and "SECRET_TOKEN" not in said
    pids = json.loads(said.split("pids ", 1)[1].splitlines()[0])
    assert len(pids) <= 4 and me not in pids  # its own namespace: bwrap's init, the runner, itself


def test_host_secrets_and_files_cannot_be_read(tmp_path: Path) -> None:
    private = tmp_path / "checkpoint.txt"
    private.write_text("trainer weights")
    said = text(
        f"""
        import os
        for path in ('/etc/shadow', {str(private)!r}, '/root', os.path.expanduser('~root')):
            try:
                print(path, os.listdir(path) if os.path.isdir(path) else open(path).read())
            except OSError as e:
                print(path, 'no:', e.strerror)
        print('uid', os.getuid(), os.geteuid())
        """
    )
    assert "trainer weights" not in said and "root:" not in said
    assert "uid 1000 1000" in said  # never root inside


def test_signals_by_any_route_do_not_reach_the_trainer(victim: subprocess.Popen[bytes]) -> None:
    me, pgid = os.getpid(), os.getpgid(victim.pid)
    said = text(
        f"""
        import ctypes, os, signal
        attempts = [
            lambda: os.kill({victim.pid}, signal.SIGKILL),
            lambda: os.kill({me}, signal.SIGKILL),
            lambda: os.killpg({pgid}, signal.SIGKILL),
            lambda: signal.pidfd_send_signal(os.pidfd_open({me}), signal.SIGKILL),
            lambda: ctypes.CDLL(None).kill({victim.pid}, 9) and (_ for _ in ()).throw(OSError(ctypes.get_errno())),
        ]
        for i, attempt in enumerate(attempts):
            try:
                attempt()
                print(i, 'sent')
            except OSError as e:
                print(i, 'no:', e)
        os.kill(-1, signal.SIGKILL)  # every process it may signal: only the jail's own
        """
    )
    assert victim.poll() is None, said
    assert "sent" not in said


def test_the_trainers_scheduling_cannot_be_changed() -> None:
    me = os.getpid()
    affinity, nice = os.sched_getaffinity(me), os.getpriority(os.PRIO_PROCESS, me)
    text(
        f"""
        import os
        for f in (lambda: os.sched_setaffinity({me}, {{0}}), lambda: os.sched_setaffinity(os.getppid(), {{0}}),
                  lambda: os.setpriority(os.PRIO_PROCESS, {me}, 19), lambda: os.setpriority(os.PRIO_USER, 0, 19),
                  lambda: os.setpriority(os.PRIO_PROCESS, os.getppid(), 19)):
            try:
                f()
            except OSError as e:
                print(e)
        """
    )
    assert os.sched_getaffinity(me) == affinity and os.getpriority(os.PRIO_PROCESS, me) == nice


def test_sqlite_cannot_write_outside_the_jail(tmp_path: Path) -> None:
    said = text(
        f"""
        import sqlite3
        for f in (lambda: sqlite3.connect('file:{tmp_path}/uri.db', uri=True).execute('create table a(x)'),
                  lambda: sqlite3.connect(':memory:').execute("attach database '{tmp_path}/att.db' as a"),
                  lambda: sqlite3.connect(':memory:').execute("vacuum into '{tmp_path}/vac.db'")):
            try:
                f()
            except sqlite3.Error as e:
                print(e)
        """
    )
    assert sorted(os.listdir(tmp_path)) == [], said


def test_no_way_into_the_trainers_network(tmp_path: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(0.1)
    accepted: list[Any] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set() and not accepted:
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=serve)
    thread.start()
    said = text(
        f"""
        import os, socket, subprocess
        for host in ('127.0.0.1', '10.0.0.1', '1.1.1.1'):
            try:
                socket.create_connection((host, {port}), timeout=1)
                print('connected', host)
            except OSError as e:
                print(host, e)
        r = subprocess.run(['nsenter', '-t', '{os.getpid()}', '-n', 'sh', '-c', 'echo in > {tmp_path}/ns'],
                           capture_output=True)
        print('nsenter', r.returncode)
        """
    )
    done.set()
    thread.join()
    server.close()
    assert not accepted and "connected" not in said
    assert not (tmp_path / "ns").exists() and "nsenter 0" not in said


def test_writes_land_only_in_the_calls_own_folder(tmp_path: Path) -> None:
    target = tmp_path / "planted"
    home = Path.home() / f"fulcrum-jail-test-{os.getpid()}"
    host_tmp = Path("/tmp") / f"fulcrum-jail-test-{os.getpid()}"
    said = text(
        f"""
        import os
        os.symlink({str(target)!r}, 'link')
        for path in ('link', {str(target)!r}, {str(home)!r}, {str(host_tmp)!r}, '/usr/escape', '/etc/escape'):
            try:
                with open(path, 'w') as f:
                    f.write('x')
                print('wrote', path)
            except OSError as e:
                print(path, e.strerror)
        print(os.getcwd(), os.environ['HOME'])
        """
    )
    assert not target.exists() and not home.exists() and not host_tmp.exists(), said
    assert not Path("/usr/escape").exists() and not Path("/etc/escape").exists()
    assert f"wrote {host_tmp}" in said  # /tmp inside is the call's own folder, gone with it


def test_a_setsid_process_does_not_outlive_its_call() -> None:
    token = f"{time.time_ns() % 10**6}.{os.getpid() % 997}"
    result = run_code(
        f"""
        import subprocess
        subprocess.Popen(['setsid', 'sleep', '{token}'], start_new_session=True)
        subprocess.Popen(['sh', '-c', 'nohup sleep {token} &'])
        print('started')
        """
    )
    assert result.response.text == "started\n"
    assert call_processes(f"sleep\0{token}") == []


def test_a_fork_bomb_is_bounded_and_ends_with_its_call() -> None:
    started = time.monotonic()
    result = run_code(
        """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError as e:
            print('stopped after', n, e.strerror)
        """,
        max_processes=20,
        default_timeout=5,
    )
    said = result.response.text or ""
    assert time.monotonic() - started < 15
    assert "stopped after" in said and int(said.split()[2]) < 20
    assert call_processes("/jail/runner.py") == []


def test_a_10_gb_allocation_is_a_memory_error() -> None:
    result = run_code("x = bytearray(10 * 2**30)")
    assert errors(result) == {"memory"}
    assert "[memory limit of 512 MB reached]" in (result.response.text or "")


def test_filling_the_disk_stops_at_the_folders_size() -> None:
    said = text(
        """
        import os
        written = 0
        try:
            for i in range(1000):
                with open(f'f{i}', 'wb') as f:
                    f.write(b'x' * 2**20)
                written += 1
        except OSError as e:
            print(written, e.strerror)
        try:
            open('/dev/shm/big', 'wb').write(b'x' * 40 * 2**20)
        except OSError as e:
            print('shm', e.strerror)
        """,
        max_disk_mb=32,
    )
    first = said.split()
    assert "No space left on device" in said and int(first[0]) <= 32
    assert "shm" in said


def test_ctypes_and_other_c_entry_points_meet_the_kernels_limits() -> None:
    said = text(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
        for name, call in (('unshare-user', lambda: libc.unshare(CLONE_NEWUSER)),
                           ('unshare-net', lambda: libc.unshare(CLONE_NEWNET)),
                           ('mount', lambda: libc.mount(b'none', b'/usr', b'tmpfs', 0, None)),
                           ('setuid', lambda: libc.setuid(0)),
                           ('ptrace', lambda: libc.ptrace(16, 1, 0, 0))):
            print(name, call(), ctypes.get_errno())
        print('uid', os.getuid())
        """
    )
    lines = dict(line.split(" ", 1) for line in said.splitlines())
    for name in ("unshare-user", "unshare-net", "mount", "setuid", "ptrace"):
        assert lines[name].startswith("-1 "), said
    assert lines["uid"] == "1000"


def test_no_jail_means_the_tool_refuses_to_start_unless_unjailed(monkeypatch: pytest.MonkeyPatch) -> None:
    from fulcrum.agent import python_tool
    from fulcrum.agent.schema import ToolConfigError

    monkeypatch.setattr(
        python_tool,
        "jail_problem",
        lambda: "no jail for model-written code: bubblewrap (`bwrap`) is not installed",
    )
    with pytest.raises(ToolConfigError, match="bwrap") as caught:
        PythonTool({}, None)
    assert "\n" not in str(caught.value)
    tool = PythonTool({"sandbox": "unjailed", "default_timeout": 10}, None)
    assert tool.unjailed
    with pytest.raises(ToolConfigError, match=r"config\.sandbox"):
        PythonTool({"sandbox": "none"}, None)
