"""The CLI guides (issue 44): training arguments after --, rm and prune, Ctrl-C leaving a follower, the resume
hint and the first run's arguments, a local host's folder, the backend told by `check`. Real processes."""

import json
import select
import signal
import socket
import sys

from conftest import latest_state, launcher_traceback, wait_for, write_spec

SLEEPER = 'command = ["{python}", "-c", "import time; print(\'up\', flush=True); time.sleep(60)"]'


def test_unknown_option_says_training_arguments_go_after_dashes(cli, tmp_path):
    spec = write_spec(tmp_path)
    for argv, start in ((("up", spec, "--epochs", "2"), "up has no option --epochs"),
                        (("check", spec, "--epochs", "2"), "check has no option --epochs")):
        r = cli(*argv, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        said = r.stderr.strip()
        assert said.startswith(f"error: {start}") and len(said.splitlines()) == 1, said  # one paragraph
        assert f"mgpu-cluster up {spec} -- --epochs 2" in said and not launcher_traceback(said), said
    r = cli("up", spec, "--detatch", timeout=60)
    assert r.returncode == 2 and "did you mean --detach?" in r.stderr, r.stderr
    assert not (cli.home / "runs").exists()  # nothing was recorded, let alone started


def test_help_names_both_backends_whole_and_version(cli):
    top = cli("--help", timeout=60).stdout
    assert "TensorFlow" in top and "Keras 3 on JAX" in top, top
    assert "..." not in top.split("Commands:")[1], top  # every summary whole
    assert cli("-V", timeout=60).stdout == cli("--version", timeout=60).stdout != ""
    up = cli("up", "-h", timeout=60).stdout
    assert up.splitlines()[0] == "Usage: mgpu-cluster up [OPTIONS] SPEC" and "--resume [RUN]" in up, up
    assert cli("rm", "-h", timeout=60).stdout.splitlines()[0] == "Usage: mgpu-cluster rm [OPTIONS] RUN..."


def _ended_run(cli, tmp_path, name: str, **kw) -> str:
    spec = write_spec(tmp_path, f'command = ["{sys.executable}", "-c", "print(1)"]', n=1, name=name, **kw)
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return latest_state(cli)["run_id"]


def test_rm_and_prune_remove_records_only(cli, tmp_path):
    done = _ended_run(cli, tmp_path, "a.toml")
    model = cli.home / "runs" / done / "hosts" / "localhost" / "checkpoint"  # as the runner leaves one
    model.mkdir(parents=True)
    (model / "owner.json").write_text("{}")
    blocker = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"', n=1, name="b.toml")
    port = int(blocker.read_text().split("port = ")[1].split()[0])
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert cli("up", blocker, timeout=120).returncode == 2  # refused: the port is taken
    refused = latest_state(cli)["run_id"]
    live_spec = write_spec(tmp_path, SLEEPER.format(python=sys.executable), n=1, name="c.toml")
    with cli.running("up", live_spec) as up:
        wait_for(lambda: (latest_state(cli) or {}).get("state") == "running", 120, "the live run")
        live = latest_state(cli)["run_id"]
        r = cli("rm", done, live, timeout=60)
        assert r.returncode == 2 and f"run {live} is running" in r.stderr and "Nothing was removed" in r.stderr, r.stderr
        assert (cli.home / "runs" / done / "state.json").exists()
        dry = cli("prune", "--dry-run", timeout=60)
        assert dry.returncode == 0 and f"would remove run {refused}" in dry.stderr + dry.stdout, dry.stderr
        assert done not in dry.stderr + dry.stdout and (cli.home / "runs" / refused).exists()
        r = cli("prune", timeout=60)
        assert r.returncode == 0 and not (cli.home / "runs" / refused).exists(), r.stdout + r.stderr
        r = cli("rm", done, timeout=60)
        assert r.returncode == 0 and "kept checkpoint" in r.stderr + r.stdout, r.stdout + r.stderr
        assert (model / "owner.json").exists() and not (cli.home / "runs" / done / "state.json").exists()
        ls = json.loads(cli("ls", "--json", timeout=60).stdout)
        assert [row["run_id"] for row in ls] == [live], ls
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)
    r = cli("prune", "--older-than", "0s", timeout=60)
    assert r.returncode == 0 and not any((cli.home / "runs").glob("*/state.json")), r.stdout + r.stderr
    assert cli("prune", "--older-than", "3x", timeout=60).returncode == 2


def test_ctrl_c_leaves_a_follower_quietly(cli, tmp_path):
    spec = write_spec(tmp_path, SLEEPER.format(python=sys.executable), n=1)
    with cli.running("up", spec) as up:
        wait_for(lambda: (latest_state(cli) or {}).get("state") == "running", 120, "the run")
        for argv in (("logs", "-f"), ("status", "--watch")):
            follower = cli.popen(*argv)
            ready, _, _ = select.select([follower.stdout], [], [], 60)  # following: printing, then waiting
            assert ready, f"{argv}: nothing printed in 60 s"
            first = follower.stdout.readline()
            assert first and follower.poll() is None, (argv, first, follower.poll())
            follower.send_signal(signal.SIGINT)
            out, _ = follower.communicate(timeout=30)
            out = first + out
            assert follower.returncode == 0, (argv, follower.returncode, out)
            assert "interrupted" not in out and "error" not in out, out
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
        assert up.returncode == 130 and "--resume" not in out, out  # a command of your own: no checkpoint of ours


def test_ctrl_c_of_up_hints_resume_and_resume_keeps_arguments(cli, tmp_path):
    # more epochs than any machine trains before the Ctrl-C lands: a run that ended has nothing to resume
    spec = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"\nepochs = 10000\nsteps_per_epoch = 3',
                      n=1)

    def an_epoch_saved():
        state = latest_state(cli) or {}
        return any((t.get("progress") or {}).get("epoch", 0) >= 3 for t in state.get("tasks", []))

    up = cli.popen("up", spec, "--", "--learning-rate", "0.001")
    try:
        wait_for(an_epoch_saved, 240, "two epochs saved")
        first = latest_state(cli)["run_id"]
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 130, out
    assert f"mgpu-cluster up {spec} --resume {first}" in out, out
    r = cli("up", spec, "--resume", first, "--dry-run", timeout=120)
    assert r.returncode == 0 and f"--learning-rate 0.001, as run {first} had them" in r.stdout + r.stderr, r.stdout
    assert (r.stdout + r.stderr).count("--learning-rate") >= 2, r.stdout  # in the task's command line too
    r = cli("up", spec, "--resume", first, "--dry-run", "--", "--learning-rate", "0.002", timeout=120)
    assert "--learning-rate 0.002 (given after -- in place of" in r.stdout + r.stderr, r.stdout
    assert "0.001" not in r.stdout.split("in place of")[-1].split("\n", 1)[-1], r.stdout


def test_local_host_runs_in_the_spec_folder_from_anywhere(cli, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "my_task.py").write_text("from worker.examples.digits import task\n")
    spec = write_spec(proj, 'entrypoint = "my_task:task"', n=1, name="my.toml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli.__class__(cli.home, elsewhere)("check", spec, timeout=120)  # cd elsewhere && check proj/my.toml
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_tells_a_tensorflow_entrypoint_on_jax(cli, tmp_path):
    spec = write_spec(tmp_path, 'entrypoint = "worker.examples.digits:task"\nbackend = "jax"', n=1)
    r = cli("check", spec, timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr
    said = r.stderr
    assert "task 0 (localhost:" in said and "Task.train_data returned _TensorSliceDataset, a tf.data.Dataset" \
        in said and "the jax backend needs (features, labels)" in said, said
    assert not launcher_traceback(said)
    spec.write_text(spec.read_text().replace("digits:task", "digits_keras3:task"))
    r = cli("check", spec, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_says_it_copies_sync_files(cli, tmp_path):
    (tmp_path / "extra.py").write_text("")
    spec = write_spec(tmp_path, n=1, launch="connect_timeout = 2")
    spec.write_text('sync = ["extra.py"]\n' + spec.read_text().replace('"localhost"', '"127.0.0.2"'))
    r = cli("check", spec, timeout=120)  # 127.0.0.2 is reached over SSH (none answers here): said first all the same
    said = r.stdout + r.stderr
    assert "copying the sync files (extra.py) to the workdir of 127.0.0.2, creating it where missing" in said, said
