"""`ls`, and which run a command without a run id acts on: real runs, a real port taken, real records."""

import json
import os
import socket
import sys

from conftest import run_processes, status_json, wait_gone, write_spec

SLEEPER = f'command = {json.dumps([sys.executable, "-c", "import time; time.sleep(600)"])}'


def ls_json(cli) -> list[dict]:
    r = cli("ls", "--json", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_a_refused_up_never_hides_the_run_that_trains(cli, tmp_path):
    empty = cli("ls", timeout=60)
    assert empty.returncode == 0 and "no runs yet" in empty.stdout, empty.stdout + empty.stderr
    training = write_spec(tmp_path, SLEEPER, name="training.toml")
    r = cli("up", "--detach", training, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        refused = write_spec(tmp_path, SLEEPER, n=1, name="refused.toml")
        port = int(refused.read_text().split("port = ")[1].split()[0])
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            bad = cli("up", refused, timeout=120)
        assert bad.returncode == 2 and "nothing was started" in bad.stdout + bad.stderr, bad.stdout + bad.stderr

        runs = ls_json(cli)
        assert [(r["state"], r["tasks"], os.path.basename(r["spec"])) for r in runs] == [
            ("refused", 1, "refused.toml"), ("running", 2, "training.toml")], runs
        assert runs[0]["run_id"] > runs[1]["run_id"] and all(r["engine"] == "supervised" for r in runs)
        assert all(r["duration_s"] >= 0 and r["started_at"] for r in runs)
        trains = runs[1]["run_id"]
        listed = cli("ls", timeout=60)
        assert listed.returncode == 0 and f"{trains}  running" in listed.stdout, listed.stdout

        status = cli("status", "--json", timeout=120)  # bare: the run that got past its preflight
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["run_id"] == trains
        assert (f"run {trains}: the newest run that did not end in its preflight; 1 newer run(s) skipped: they ended in "
                "their preflight") in status.stderr
        refused_id = runs[0]["run_id"]
        refused_snap = status_json(cli, refused_id)  # named, it is still there, and `status` says what `ls` says
        assert refused_snap["failure"]["kind"] == "refused" and refused_snap["state"] == "refused", refused_snap
        assert cli("status", refused_id, timeout=60).stdout.startswith(f"run {refused_id}: refused")
    finally:
        down = cli("down", timeout=120)  # bare: stops the training run, not the refused one
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"run {trains}: every task is stopped" in down.stdout and trains in down.stderr
    assert not wait_gone(cli.home, 10)
    assert [r["state"] for r in ls_json(cli)] == ["refused", "stopped"]


def test_ls_lists_a_damaged_record_and_a_bad_run_id_is_one_paragraph(cli, tmp_path):
    folder = cli.home / "runs" / "20261125-101010-0a0b"
    folder.mkdir(parents=True)
    (folder / "state.json").write_bytes(b"\xff\xfe{not json")
    runs = ls_json(cli)
    assert [(r["run_id"], r["state"]) for r in runs] == [("20261125-101010-0a0b", "damaged")], runs
    assert "corrupt" in runs[0]["why"]
    shown = cli("ls", timeout=60)
    assert shown.returncode == 0 and "damaged" in shown.stdout, shown.stdout + shown.stderr
    for bad in ("../../etc", "nope"):
        r = cli("status", bad, timeout=60)
        assert r.returncode == 2 and "is not a run id" in r.stderr and "Traceback" not in r.stderr, r.stderr
    bare = cli("status", timeout=60)  # the only run is damaged: said, as the newest
    assert bare.returncode == 2 and "is corrupt" in bare.stderr and "Traceback" not in bare.stderr, bare.stderr
    assert not run_processes(cli.home)
