"""`check` and the CLI's start-up: real sockets, real interpreters, no TensorFlow in the launcher."""

import os
import socket
import subprocess
import sys

from conftest import REPO, free_port


def spec_text(ports, training='entrypoint = "worker.examples.digits:task"', extra=""):
    hosts = "".join(f'[[hosts]]\naddress = "localhost"\nport = {p}\n{extra}' for p in ports)
    return hosts + f"[training]\n{training}\n"


def test_help_never_imports_tensorflow():
    code = ("import sys, launcher.cli as c\n"
            "from typer.main import get_command\n"
            "try:\n    get_command(c.app).main(['--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
            "import pkgutil, launcher\n"
            "for m in pkgutil.iter_modules(launcher.__path__):\n"
            "    if m.name not in ('ssh', '__main__'):\n"
            "        __import__('launcher.' + m.name)\n"
            "bad = [m for m in ('tensorflow', 'tf_keras', 'keras', 'fabric', 'paramiko') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "check" in r.stdout and "status" in r.stdout


def test_console_script_help(cli):
    r = subprocess.run(["mgpu-cluster", "--help"], capture_output=True, text=True, env=cli.env)
    assert r.returncode == 0 and "up" in r.stdout


def test_check_passes_on_free_ports(cli, tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text(spec_text([free_port(), free_port()]))
    r = cli("check", spec, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok ") == 2


def test_check_names_port_and_holder_pid(cli, tmp_path):
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    other = free_port()
    try:
        spec = tmp_path / "c.toml"
        spec.write_text(spec_text([other, port]))
        r = cli("check", spec, timeout=60)
    finally:
        holder.close()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"[1] task 1 (localhost:{port}): port {port} is in use by pid {os.getpid()}" in " ".join(out.split())
    assert out.count(f"in use by pid {os.getpid()} (") == 1 and "Traceback" not in out, out  # told once


def test_check_reports_missing_interpreter_module_and_program(cli, tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text(spec_text([free_port()], extra='python = "/nonexistent/python9"\n'))
    r = cli("check", spec, timeout=60)
    assert r.returncode == 2 and "/nonexistent/python9" in r.stderr and "cannot be run" in r.stderr, r.stderr

    spec.write_text(spec_text([free_port()], training='entrypoint = "no_such_pkg.mod:task"'))
    r = cli("check", spec, timeout=60)
    assert r.returncode == 2 and "no_such_pkg.mod" in r.stderr, r.stderr

    spec.write_text(spec_text([free_port()], training='entrypoint = "worker.examples.digits:no_such_fn"'))
    r = cli("check", spec, timeout=60)
    assert r.returncode == 2 and "no_such_fn" in r.stderr, r.stderr

    spec.write_text(spec_text([free_port()], training='command = ["no-such-program-xyz", "a"]'))
    r = cli("check", spec, timeout=60)
    assert r.returncode == 2 and "no-such-program-xyz" in r.stderr, r.stderr


def test_check_finds_entrypoint_in_the_working_folder(cli, tmp_path):
    (tmp_path / "mytrain.py").write_text("import tensorflow\ndef task(cfg=None):\n    pass\n")
    spec = tmp_path / "c.toml"
    spec.write_text(spec_text([free_port()], training='entrypoint = "mytrain:task"'))
    r = cli("check", spec, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
