"""The launcher installs and runs without TensorFlow; the worker side comes with an extra."""

import os
import subprocess
import sys
import venv

import pytest

from conftest import REPO, write_spec


@pytest.mark.cluster
def test_launcher_installs_and_runs_without_tensorflow(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    have_tf = subprocess.run([py, "-c", "import tensorflow"], capture_output=True, timeout=60)
    assert have_tf.returncode != 0, "pip install . pulled in TensorFlow"
    exe = str(env_dir / "bin" / "mgpu-cluster")
    env = {**os.environ, "MGPU_HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)
    run = lambda *args: subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=120,  # noqa: E731
                                       cwd=tmp_path, env=env)
    assert run("--help").returncode == 0
    spec = write_spec(tmp_path, f'command = ["{sys.executable}", "-c", "pass"]', n=2,
                      extra=f'python = "{py}"\n')
    check = run("check", spec)
    assert check.returncode == 0, check.stdout + check.stderr
    up = run("up", spec)
    assert up.returncode == 0, up.stdout + up.stderr
    status = run("status")
    assert status.returncode == 0 and "succeeded" in status.stdout, status.stdout + status.stderr
