"""Every run says where it starts (fresh, or run X's backup at epoch N, step S) on screen and in `status --json`,
and a new run never takes another run's checkpoint unless `--resume` names that run; with nothing left to train it
is refused. Real runs of one tiny task sharing a spec's checkpoint_dir."""

from __future__ import annotations

import json

from conftest import free_port, latest_state, status_json, wait_for, write_spec
from test_dashboard import dashboard, scrape
from worker.host.startpoint import Found, Refused, StartPoint, decide, look, options

FAILING = '''import os

from worker.examples.digits import task as digits


def task():
    from worker.tensorflow.strategy import import_keras

    keras = import_keras()
    flag = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fail-at-epoch")

    def end(epoch, logs):
        if os.path.exists(flag) and open(flag).read().strip() == str(epoch + 1):
            os.remove(flag)
            raise RuntimeError(f"planned failure at the end of epoch {epoch + 1}")

    t = digits()
    t.callbacks = lambda: [keras.callbacks.LambdaCallback(on_epoch_end=end)]
    return t
'''
STEPS = 3


def one_line(r) -> str:
    return " ".join((r.stdout + r.stderr).split())


def spec_for(tmp_path, epochs: int):
    wd = tmp_path / "wd"
    wd.mkdir(exist_ok=True)
    (wd / "failing.py").write_text(FAILING)
    training = (f'entrypoint = "failing:task"\nepochs = {epochs}\nsteps_per_epoch = {STEPS}\n'
                'batch_size_per_replica = 16\ncheckpoint_dir = "ckpt"')
    return write_spec(tmp_path, training, n=1, each='workdir = "wd"\n'), wd


def test_a_new_run_refuses_another_runs_checkpoint_and_resumes_it_when_asked(cli, tmp_path):
    spec, wd = spec_for(tmp_path, epochs=2)
    (wd / "fail-at-epoch").write_text("1")
    r = cli("up", spec, timeout=300)
    assert r.returncode == 1, one_line(r)
    first = status_json(cli)
    assert f"run {first['run_id']} starts fresh" in one_line(r)
    assert first["start"] == {"run": None, "epoch": 1, "step": 1, "steps_done": 0}, first
    owner = json.loads((wd / "ckpt" / "owner.json").read_text())
    assert owner == {"run": first["run_id"], "epoch": 2, "step": 1, "steps_done": STEPS}, owner

    # a new run is refused, naming the run whose backup it is and the choices; nothing is started
    r = cli("up", spec, timeout=120)
    said = one_line(r)
    assert r.returncode == 2, said
    assert f"holds run {first['run_id']}'s backup (at epoch 2, step 1)" in said, said
    assert f"--resume {first['run_id']}" in said and "start fresh" in said, said
    refused = latest_state(cli)  # (a bare status shows the newest run past its preflight)
    assert refused["state"] == "failed" and refused["start"] is None and refused["attempts"] == [], refused
    assert refused["failure"]["kind"] == "refused", refused

    # asked, it resumes there, and says so once on screen and in status --json
    r = cli("up", spec, "--resume", first["run_id"], timeout=300)
    said = one_line(r)
    assert r.returncode == 0, said
    second = status_json(cli)
    assert f"run {second['run_id']} resumes run {first['run_id']} at epoch 2, step 1" in said, said
    assert said.count(f"resumes run {first['run_id']}") == 1, said
    assert second["start"] == {"run": first["run_id"], "epoch": 2, "step": 1, "steps_done": STEPS}, second
    assert "resuming at epoch 2" in said and "epoch 1/2" not in said, said  # epoch 1 is not trained again
    with dashboard(cli) as (_first, url, _port, token):  # its steps in /metrics are its own, not the resumed run's
        scraped = scrape(url, token)
    assert second["group"]["global_step"] == 2 * STEPS, second["group"]  # the model's steps
    assert scraped[("mgpu_task_step", (("run", second["run_id"]), ("task", "0")))] == STEPS, scraped
    assert scraped[("mgpu_group_step", (("run", second["run_id"]),))] == STEPS, scraped

    # the folder now holds the second run's finished training: a new run is refused naming it
    r = cli("up", spec, timeout=120)
    assert r.returncode == 2 and f"holds run {second['run_id']}'s finished training" in one_line(r), one_line(r)
    r = cli("up", spec, "--resume", second["run_id"], timeout=120)
    assert r.returncode == 2 and "nothing is left to train" in one_line(r), one_line(r)


def test_a_folder_in_use_by_a_live_run_is_refused_to_another_even_before_its_first_backup(cli, tmp_path):
    spec, wd = spec_for(tmp_path, epochs=400)
    r = cli("up", "--detach", spec, timeout=300)
    assert r.returncode == 0, one_line(r)
    first = status_json(cli)["run_id"]
    try:
        owner = wd / "ckpt" / "owner.json"  # the chief claims the folder at its start, before any backup
        wait_for(lambda: owner.exists() and json.loads(owner.read_text())["run"] == first, 120, "the folder claimed")
        other = tmp_path / "other.toml"  # the same folder on other ports (the first run holds its own)
        other.write_text(spec.read_text().replace(spec.read_text().split("port = ")[1].split()[0], str(free_port())))
        r = cli("up", other, timeout=120)
        said = one_line(r)
        assert r.returncode == 2, said
        assert f"is in use by run {first}, which is running on this host now" in said, said
        assert f"mgpu-cluster down {first}" in said and "Traceback" not in said, said
        r = cli("up", other, "--resume", first, timeout=120)  # going on from it is refused while it runs, too
        assert r.returncode == 2 and f"--resume {first}: that run has not ended" in one_line(r), one_line(r)
        assert status_json(cli, first)["state"] == "running"  # untouched
    finally:
        down = cli("down", first, timeout=120)
    assert down.returncode == 0, one_line(down)


def test_resume_of_a_run_whose_backup_is_at_its_end_trains_nothing_and_is_refused(cli, tmp_path):
    spec, wd = spec_for(tmp_path, epochs=1)
    (wd / "fail-at-epoch").write_text("1")  # fails after the last epoch's backup: nothing is left
    r = cli("up", spec, timeout=300)
    assert r.returncode == 1, one_line(r)
    first = status_json(cli)
    r = cli("up", spec, "--resume", first["run_id"], timeout=120)
    said = one_line(r)
    assert r.returncode == 2, said
    assert f"--resume {first['run_id']}: its backup in" in said and "is at the end of epoch 1" in said, said
    assert "nothing is left to train" in said, said
    assert latest_state(cli)["failure"]["kind"] == "refused"  # never 'succeeded'


def test_the_rule_on_what_a_folder_holds(tmp_path):
    """Pure: the owner file is untrusted; the run's own backup (a restart) resumes; the worker's options read."""
    (tmp_path / "chief").mkdir()
    (tmp_path / "chief" / "checkpoint").write_text("x")
    (tmp_path / "owner.json").write_text('{"run": "a", "epoch": 3, "step": 2, "steps_done": 8}')
    found = look(str(tmp_path))
    assert found.owner == StartPoint("a", 3, 2, 8) and found.backup
    assert decide(found, "a", None, 2) == StartPoint("a", 3, 2, 8)  # a restart of run a: its own, as before
    assert decide(found, "b", "a", 5).run == "a"
    for run, resume, epochs in (("b", None, 5), ("b", "c", 5), ("b", "a", 2)):
        try:
            decide(found, run, resume, epochs)
            raise AssertionError("not refused")
        except Refused:
            pass
    (tmp_path / "owner.json").write_text('{"run": "a", "epoch": true, "step": -1}')
    assert look(str(tmp_path)).owner is None
    assert Found.from_json({"folder": 3}) is None and decide(Found("x"), "b", None, None).fresh
    said = options(["python", "-m", "worker", "--epochs", "4", "--checkpoint-dir=c", "--resume-run", "r"])
    assert (said.checkpoint_dir, said.resume_run, said.epochs, said.folders) == ("c", "r", 4, ["c"])
