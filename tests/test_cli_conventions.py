"""The command line's conventions: -h, --version, -n/--tail, -o/--output, the order of the commands, metavars."""

import json
import re
import subprocess
import sys
from importlib.metadata import version

from conftest import write_spec

COMMANDS = ["check", "up", "ls", "status", "logs", "stacks", "report", "dashboard", "down", "fetch", "rm", "prune", "render", "tf-config", "schema"]


def help_of(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "launcher", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_help_version_order_and_metavars():
    top = help_of("--help")
    assert help_of("-h") == top and top.startswith("Usage: mgpu-cluster ")
    listed = re.findall(r"^  ([a-z-]+)  ", top.split("Commands:")[1], re.M)
    assert listed == COMMANDS, listed  # in the order of a run's life, then the tools
    assert help_of("--version").strip() == f"mgpu-cluster {version('mgpu-cluster')}"
    for command in COMMANDS:
        text = help_of(command, "-h")
        usage = text.splitlines()[0]
        assert not re.search(r"\[?<?[a-z]+>?\]?$", usage.split("[OPTIONS]")[-1].strip()), usage  # SPEC, [RUN]
        assert not re.search(r"--[a-z-]+ (<[a-z]+>|INTEGER|TEXT|PATH)", text), (command, text)
    for command in ("report", "render", "fetch"):
        assert "-o, --output" in help_of(command, "-h")
    assert "-n, --tail K" in help_of("logs", "-h")


def test_logs_tail_short_and_long_agree(cli, tmp_path):
    lines = "; ".join(f"print('line {i}')" for i in range(6))
    spec = write_spec(tmp_path, f'command = {json.dumps([sys.executable, "-c", lines])}', n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    short, long = cli("logs", "-n", "2", timeout=60), cli("logs", "--tail", "2", timeout=60)
    assert short.returncode == 0 and short.stdout == long.stdout, short.stdout + short.stderr
    assert "line 5" in short.stdout and "line 4" in short.stdout and "line 3" not in short.stdout, short.stdout
    assert "the newest run that did not end in its preflight" in short.stderr
