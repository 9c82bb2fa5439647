"""Values that only look valid: a name ending in a newline (Python's `$` matches before one), a run record whose
numbers are NaN, infinite or beyond their range, and output paths that are folders or empty. Each is refused
where it enters, in one paragraph (exit 2), and a damaged record never hides the other runs."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys

import pytest

from conftest import REPO, write_spec
from launcher.errors import SpecError
from launcher.run import fields
from launcher.run.record import RunRecord
from launcher.spec.file import parse_spec

PY = sys.executable
K8S = {"image": "img", "workers": 2, "volume_claim": "runs"}
TRAIN = {"command": ["x"]}

# (table, key path inside it, a valid value): every spec field whose value a pattern checks
PATTERNED = [
    ("hosts", ("env", "NAME"), None),  # the name is the key
    ("training", ("entrypoint",), "worker.examples.digits:task"),
    ("slurm", ("partition",), "debug"),
    ("slurm", ("time",), "2:00:00"),
    ("slurm", ("env", "NAME"), None),
    ("kubernetes", ("name",), "train"),
    ("kubernetes", ("namespace",), "team-a"),
    ("kubernetes", ("volume_claim",), "runs"),
    ("kubernetes", ("service_account",), "trainer"),
    ("kubernetes", ("priority_class",), "high"),
    ("kubernetes", ("image_pull_secrets", 0), "regcred"),
    ("kubernetes", ("cpu",), "4"),
    ("kubernetes", ("memory",), "16Gi"),
    ("kubernetes", ("shm",), "1Gi"),
    ("kubernetes", ("secret_env", "WANDB_API_KEY", "secret"), "wandb"),
    ("kubernetes", ("secret_env", "WANDB_API_KEY", "key"), "api-key"),
    ("kubernetes", ("labels", "team"), "vision"),
    ("kubernetes", ("labels", "KEY"), None),
    ("kubernetes", ("node_selector", "pool"), "a100"),
    ("kubernetes", ("node_selector", "KEY"), None),
    ("kubernetes", ("annotations", "KEY"), None),
    ("kubernetes", ("tolerations", 0, "key"), "nvidia.com/gpu"),
    ("kubernetes", ("tolerations", 0, "value"), "present"),
    ("kubernetes", ("env", "NAME"), None),
]


def spec_with(table: str, path: tuple, value: str) -> dict:
    """A valid spec dict whose field at `path` in `table` is `value` (a path ending in NAME or KEY: the key)."""
    data = {"training": dict(TRAIN), "hosts": [{"address": "localhost", "port": 20000}],
            "slurm": {"nodes": 2, "workdir": "/shared"},
            "kubernetes": {**K8S, "image_pull_secrets": ["regcred"], "tolerations": [{"key": "k", "value": "v"}],
                           "secret_env": {"WANDB_API_KEY": {"secret": "wandb", "key": "api-key"}}}}
    keep = "hosts" if table in ("hosts", "training") else table
    data = {k: v for k, v in data.items() if k in ("training", keep)}
    holder = data[table][0] if table == "hosts" else data[table]
    *parents, last = path
    for part in parents:
        holder = holder[part] if isinstance(holder, list) or part in holder else holder.setdefault(part, {})
    if table == "training":
        holder.pop("command")
    if last in ("NAME", "KEY"):
        holder[value] = "x"
    else:
        holder[last] = value
    return data


@pytest.mark.parametrize("table,path,valid", PATTERNED, ids=lambda x: ".".join(map(str, x)) if isinstance(x, tuple)
                         else None)
def test_every_patterned_spec_value_is_taken_whole_a_trailing_newline_refused(table, path, valid):
    good = "team" if valid is None else valid
    parse_spec(spec_with(table, path, good))  # as it is: taken
    with pytest.raises(SpecError) as refused:
        parse_spec(spec_with(table, path, good + "\n"))
    said = str(refused.value)
    assert f"{table}" in said and f"{path[0]}" in said, said


def test_no_validating_pattern_ends_in_a_dollar():
    """`$` matches before a trailing newline: every pattern that checks a whole value ends in \\Z."""
    from launcher.engines.slurm import script
    from launcher.run import home
    from launcher.spec import base as specbase
    from launcher.spec import kubernetes as speck8s
    from launcher.spec import slurm as specsched
    from worker.host import layout, modules
    from worker.task import program

    found = {f"{m.__name__}.{name}": p.pattern for m in (home, specbase, speck8s, specsched, script, layout, modules,
                                                          program)
             for name, p in vars(m).items() if isinstance(p, re.Pattern)}
    assert len(found) >= 17, found
    assert not {name: p for name, p in found.items() if "$" in p}, found
    assert not home.RUN_ID.match("20261125-101010-0a0b\n") and not script.SAFE.match("word\n")


def test_render_refuses_a_label_with_a_trailing_newline(cli, tmp_path):
    spec = tmp_path / "k8s.toml"
    spec.write_text('[kubernetes]\nimage = "img"\nworkers = 1\nlabels = { team = "vision\\n" }\n'
                    '[training]\ncommand = ["x"]\n')
    r = cli("render", spec, timeout=60)
    assert r.returncode == 2 and "kubernetes.labels" in r.stderr and "label value" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and not r.stdout


# --------------------------------------------------------------------------- numbers of a run record

def _record() -> dict:
    task = {"index": 0, "host": "h", "address": "h", "port": 20000, "run_dir": "/r", "state": "succeeded",
            "pid": 4242, "create_time": 1.7e9, "started_at": 1.7e9, "ended_at": 1.7e9 + 5, "cpu_percent": 99.0}
    return {"run_id": "20261125-101010-0a0b", "spec_path": "/s.toml", "state": "succeeded", "version": 3,
            "created_at": 1.7e9, "ended_at": 1.7e9 + 9, "phases": {"preflight_s": 0.1},
            "attempts": [{"number": 0, "started_at": 1.7e9, "ended_at": 1.7e9 + 8, "tasks": [0]}], "tasks": [task]}


NUMBERS = [("created_at",), ("ended_at",), ("agent_create_time",), ("restarts",), ("attempt",),
           ("phases", "preflight_s"),
           ("attempts", 0, "started_at"), ("attempts", 0, "ended_at"), ("attempts", 0, "number"),
           ("tasks", 0, "pid"), ("tasks", 0, "port"), ("tasks", 0, "started_at"), ("tasks", 0, "heartbeat"),
           ("tasks", 0, "cpu_percent"), ("tasks", 0, "rss"), ("tasks", 0, "exit_code"), ("tasks", 0, "index")]
BAD = [float("nan"), float("inf"), -float("inf"), 1e20, 10**400]


@pytest.mark.parametrize("path", NUMBERS, ids=lambda p: ".".join(map(str, p)))
def test_every_number_of_a_record_is_finite_and_in_range_or_the_record_is_damaged(path):
    RunRecord.from_json(json.dumps(_record()))
    for bad in BAD:
        data = copy.deepcopy(_record())
        holder = data
        for part in path[:-1]:
            holder = holder[part]
        holder[path[-1]] = bad
        with pytest.raises(TypeError, match=re.escape(path[-1])):  # OutOfRange where the type is right
            RunRecord.from_json(json.dumps(data))  # Python's json writes NaN and Infinity, and reads them


def test_times_beyond_what_a_clock_shows_and_negative_counts_are_damaged():
    for path, bad in ((("created_at",), 1e12), (("tasks", 0, "heartbeat"), -1.0), (("restarts",), -1),
                      (("tasks", 0, "pid"), 2**40), (("tasks", 0, "port"), 70000), (("tasks", 0, "cpu_percent"), -5.0)):
        data = _record()
        holder = data
        for part in path[:-1]:
            holder = holder[part]
        holder[path[-1]] = bad
        with pytest.raises(fields.OutOfRange, match="is not within"):
            RunRecord.from_json(json.dumps(data))


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_record_with_nan_or_huge_numbers_is_listed_damaged_and_the_others_still_are(cli, tmp_path, monkeypatch):
    spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', 'pass'])}", n=1)
    up = cli("up", spec, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    runs = cli.home / "runs"
    (good,) = [p.name for p in runs.iterdir()]
    damaged = {}
    for i, (key, bad) in enumerate((("created_at", "NaN"), ("ended_at", "1e20"), ("heartbeat", "Infinity"))):
        run_id = good[:-4] + f"fff{i + 0xa:x}"  # newer than the good run's id (of the same second)
        shutil.copytree(runs / good, runs / run_id)
        state = runs / run_id / "state.json"
        data = json.loads(state.read_text())
        data["run_id"] = run_id
        text = json.dumps(data, indent=1)
        state.write_text(re.sub(rf'"{key}": [^,\n]+', f'"{key}": {bad}', text, count=1))
        damaged[run_id] = key

    listed = cli("ls", timeout=60)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stdout + listed.stderr
    for run_id in damaged:
        assert re.search(rf"{run_id}\s+damaged", listed.stdout), listed.stdout
    assert re.search(rf"{good}\s+succeeded", listed.stdout), listed.stdout

    as_json = cli("ls", "--json", timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    rows = {r["run_id"]: r for r in _strict_json(as_json.stdout)}
    assert rows[good]["state"] == "succeeded" and rows[good]["duration_s"] >= 0
    for run_id, key in damaged.items():
        assert rows[run_id]["state"] == "damaged" and key in rows[run_id]["why"], rows[run_id]

    for run_id, key in damaged.items():
        r = cli("status", run_id, timeout=60)
        assert r.returncode == 2 and "is corrupt" in r.stderr and key in r.stderr, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    bare = cli("status", timeout=60)  # the newest run is damaged: said, in one paragraph
    assert bare.returncode == 2 and "is corrupt" in bare.stderr and "Traceback" not in bare.stderr, bare.stderr
    shown = cli("status", "--json", good, timeout=60)
    assert shown.returncode == 0 and _strict_json(shown.stdout)["state"] == "succeeded", shown.stderr

    monkeypatch.setenv("MGPU_HOME", str(cli.home))  # the page's list: the same rows, valid JSON
    from launcher.dashboard import data as page

    on_page = page.run_list()
    json.dumps(on_page, allow_nan=False)
    listed_page = {r["run_id"]: r["state"] for r in (on_page["runs"] if isinstance(on_page, dict) else on_page)}
    assert listed_page == {good: "succeeded", **dict.fromkeys(damaged, "damaged")}


# --------------------------------------------------------------------------- output paths

def test_an_output_path_that_is_a_folder_empty_or_nowhere_is_one_paragraph(cli, tmp_path):
    spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', 'pass'])}", n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    (tmp_path / "out").mkdir()
    cases = {".": "names a folder", "": "not a file name", "out/": "names a folder", str(tmp_path / "out"):
             "names a folder", "missing/r.png": "does not exist", "/dev/null": "not a regular file"}
    for verb, args in (("report", ()), ("render", (REPO / "cluster.k8s.toml",))):
        for path, said in cases.items():
            r = cli(verb, *args, "-o", path, timeout=120)
            out = r.stdout + r.stderr
            assert r.returncode == 2 and said in r.stderr and "Traceback" not in out, (verb, path, out)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        fine = tmp_path / f"{verb}.out"
        r = cli(verb, *args, "-o", fine, timeout=120)
        assert r.returncode == 0 and fine.stat().st_size > 0, r.stdout + r.stderr
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "out").iterdir())
