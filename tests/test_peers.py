"""Who is at the other end (issue 54, class 1): a meeting point between our own processes is checked from both ends
before a byte of the task's is sent. A fork server's abstract name has no permissions: a process of another local
account (`nobody`, a real one) that took the name first gets nothing, and the attempt starts cold saying why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import IN_CI

OTHER_UID = 65534  # nobody: another local account on every Debian machine

LISTEN = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind("\\0" + sys.argv[1])
s.listen(1)
print("listening", flush=True)
conn, _ = s.accept()
conn.settimeout(3)
got = 0
try:
    while True:
        data = conn.recv(65536)
        if not data:
            break
        got += len(data)
except OSError:
    pass
print(f"got {got}", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0 and not IN_CI, reason="needs root to run a process as another account")
def test_a_fork_server_name_taken_by_another_account_is_refused_and_sent_nothing(tmp_path):
    from worker.task.warm import NameTaken, Server

    name = f"mgpu-fork/{os.getuid()}/test-{os.getpid()}/0"
    other = subprocess.Popen(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                              sys.executable, "-c", LISTEN, name], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "listening"
        with pytest.raises(NameTaken) as refused:
            Server.open(name, dict(os.environ), str(tmp_path), tmp_path / "server.log", idle=True, ours=None)
        said = str(refused.value)
        assert f"held by a process of another account (pid {other.pid}, uid {OTHER_UID})" in said, said
        assert "was sent nothing" in said and said.count("\n") == 0, said
        out, _ = other.communicate(timeout=10)
        assert out.strip() == "got 0", out  # not a byte of the task's environment or output
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
