"""`mgpu-cluster dashboard`: the server as a user starts it (its errors, the token), /metrics of a live digits
run, and the run's page in a real Chromium driven by Playwright (the system's browser, nothing downloaded)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import shared_runs
from conftest import IN_CI, STACK_HEADER, Cli, free_port, status_json, wait_for, write_spec

CHROMIUM = "/usr/bin/chromium"
MARKUP = "<img src=x onerror=document.title='pwned'>.toml"  # a spec's file name
SERIES = ["mgpu_task_step", "mgpu_task_samples_per_second", "mgpu_task_heartbeat_age_seconds",
          "mgpu_task_compute_ms", "mgpu_task_wait_ms", "mgpu_task_up", "mgpu_task_epoch", "mgpu_task_loss",
          "mgpu_task_cpu_percent", "mgpu_task_memory_bytes"]


@contextlib.contextmanager
def dashboard(cli: Cli, *args: str):
    """`mgpu-cluster dashboard --port P ARGS` until the block ends: (its first line, its URL, its port, its token)."""
    port = free_port()
    proc = cli.popen("dashboard", "--port", str(port), *args)
    try:
        first = proc.stdout.readline()
        assert first.startswith("dashboard: http://") and "?token=" in first, first + proc.stdout.read()
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _reachable(port), 30, "the dashboard to answer")
        yield first, url, port, first.split("?token=")[1].split()[0]
    finally:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C
        try:
            proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _reachable(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def get(url: str, headers: dict | None = None, method: str = "GET", token: str | None = None) -> tuple[int, dict, str]:
    headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers, method=method), timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


# --------------------------------------------------------------------------- the server, no run needed

def test_port_in_use_and_a_missing_extra_are_one_paragraph_exit_2(tmp_path):
    cli = Cli(tmp_path / "home", tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = cli("dashboard", "--port", str(taken.getsockname()[1]), timeout=60)
    assert r.returncode == 2 and "is in use" in r.stderr and "--port" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n\n") == 0, r.stderr
    without = ("import sys; sys.modules['uvicorn'] = None; sys.argv = ['mgpu-cluster', 'dashboard']; "
               "from launcher.cli import main; main()")  # as if the extra were not installed
    r = subprocess.run([sys.executable, "-c", without], capture_output=True, text=True, timeout=60, env=cli.env)
    assert r.returncode == 2 and "pip install 'mgpu-cluster[dashboard]'" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr


DATA = ["/api/runs", "/api/runs/20261126-000000-abcd", "/api/runs/20261126-000000-abcd/logs",
        "/api/runs/20261126-000000-abcd/series", "/metrics", "/nowhere"]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_on_every_address_data_needs_the_printed_token_and_no_cookie_carries_it(tmp_path, host):
    cli = Cli(tmp_path / "home", tmp_path)
    with dashboard(cli, "--host", host) as (first, url, _, token):
        assert len(token) >= 24 and f"Authorization: Bearer {token}" in first, first
        for path in DATA:
            assert get(url + path)[0] == 401, path
            assert get(url + path, token="wrong")[0] == 401, path
            assert get(url + path + f"?token={token}")[0] == 401, path  # only in its header: never in a URL's log
        for path in ("/", f"/?token={token}", "/runs/20261126-000000-abcd", "/static/run.js"):
            code, headers, body = get(url + path)  # the page's own files hold no run data
            assert code == 200 and "set-cookie" not in {k.lower() for k in headers}, (path, headers)
            assert "default-src 'self'" in headers["content-security-policy"]
        code, headers, body = get(f"{url}/api/runs", token=token)
        assert (code, json.loads(body)) == (200, {"runs": [], "total": 0}), body
        assert "set-cookie" not in {k.lower() for k in headers}, headers
        code, _, text = get(f"{url}/metrics", token=token)
        assert code == 200 and "Traceback" not in text


def test_on_loopback_only_loopback_names_and_no_cross_site_post(tmp_path):
    cli = Cli(tmp_path / "home", tmp_path)
    with dashboard(cli) as (_, url, port, token):
        assert get(f"{url}/api/runs", token=token)[0] == 200
        assert get(f"{url}/api/runs", {"Host": f"evil.example:{port}"}, token=token)[0] == 421  # DNS rebinding
        run = "20261126-000000-abcd"
        assert get(f"{url}/api/runs/{run}/stacks", method="POST", token=token)[0] == 403  # a form of another site
        code, _, text = get(f"{url}/api/runs/{run}/stacks", {"X-Mgpu-Dashboard": "1"}, method="POST", token=token)
        assert code == 404 and "not found" in json.loads(text)["error"], text
        assert get(f"{url}/api/runs/{run}/stacks", {"X-Mgpu-Dashboard": "1"}, method="POST")[0] == 401
        assert get(f"{url}/runs/..%2F..%2Fetc", token=token)[0] == 404
        assert get(f"{url}/api/runs/nope", token=token)[0] == 404


needs_root = pytest.mark.skipif(os.geteuid() != 0 and not IN_CI,
                                reason="needs root to add a second local user (never skipped under CI=true)")

SYSTEM_PYTHON = "/usr/bin/python3"  # the other user cannot run ours (under root's home)
PEEK = """import json, sys, urllib.error, urllib.request
codes = {}
for path in sys.argv[2:]:
    try:
        with urllib.request.urlopen(sys.argv[1] + path, timeout=30) as r:
            codes[path] = [r.status, r.read().decode()]
    except urllib.error.HTTPError as exc:
        codes[path] = [exc.code, exc.read().decode()]
print(json.dumps(codes))
"""


@needs_root
def test_another_local_user_reads_no_run_nor_log_and_takes_no_stacks(cli, tmp_path):
    """A second account on this machine, on the dashboard's loopback port, gets 401 for the runs, a run, its log,
    series, metrics and stacks; the page's own files (no run data) are all it reads."""
    spec = write_spec(tmp_path, 'command = ["python3", "-c", "print(\'a secret in the log\')"]', n=1)
    assert cli("up", spec, timeout=120).returncode == 0
    run = status_json(cli)["run_id"]
    user = f"mgpu-dash{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", user], check=True)
    try:
        with dashboard(cli) as (_, url, _, token):
            paths = ["/api/runs", f"/api/runs/{run}", f"/api/runs/{run}/logs", f"/api/runs/{run}/series", "/metrics",
                     "/", f"/runs/{run}"]
            peek = subprocess.run(["runuser", "-u", user, "--", SYSTEM_PYTHON, "-c", PEEK, url, *paths],
                                  capture_output=True, text=True, timeout=120, cwd="/")
            assert peek.returncode == 0, peek.stderr
            seen = json.loads(peek.stdout)
            assert {p: seen[p][0] for p in paths[:5]} == {p: 401 for p in paths[:5]}, seen
            assert all(seen[p][0] == 200 and run not in seen[p][1] for p in paths[5:]), seen
            post = ("import urllib.request, sys; r = urllib.request.Request(sys.argv[1], method='POST', "
                    "headers={'X-Mgpu-Dashboard': '1'})\ntry: urllib.request.urlopen(r, timeout=60)\n"
                    "except urllib.error.HTTPError as e: print(e.code)")
            stacks = subprocess.run(["runuser", "-u", user, "--", SYSTEM_PYTHON, "-c", post,
                                     f"{url}/api/runs/{run}/stacks"], capture_output=True, text=True, timeout=120)
            assert stacks.stdout.strip() == "401", stacks.stdout + stacks.stderr
            code, _, logs = get(f"{url}/api/runs/{run}/logs", token=token)  # the owner, with the token
            assert code == 200 and "a secret in the log" in logs, logs
            assert "a secret in the log" not in peek.stdout
    finally:
        subprocess.run(["userdel", user], check=False)


# --------------------------------------------------------------------------- a live run

# a task that trains for good, as a user's own loop reports it (worker.training.progress): a step every 0.05 s (its split
# too), an epoch every 20 steps with its line's figures; the dashboard's figures are read from what it writes, as from Keras'
LIVE = """import os, time
from worker.training.progress import ProgressWriter
w = ProgressWriter(os.environ["MGPU_RUN_DIR"], task=int(os.environ["MGPU_TASK_INDEX"]), epochs=500,
                   steps_per_epoch=20, interval=0.2)
start, val = time.time(), {}
for n in range(1, 10 ** 6):
    epoch, step = 1 + (n - 1) // 20, 1 + (n - 1) % 20
    w.update(state="training", epoch=epoch, step=step, global_step=n, loss=2.0 / n,
             metrics={"accuracy": 1 - 1 / n, **val}, samples_per_sec=640.0, epoch_samples=32 * step,
             epoch_train_s=0.05 * step, compute_ms=30.0, wait_ms=20.0)
    if step == 20:
        val = {"val_loss": 1.0 / epoch}  # as Keras' logs: validation's figures from an epoch's end on
        w.epoch_end(epoch, start, 2.0 / n, {"accuracy": 1 - 1 / n, **val})
        print(f"epoch {epoch}/500 loss={2.0 / n:.4g}", flush=True)
        start = time.time()
    time.sleep(0.05)
"""


def live_run(cli: Cli, tmp_path, name: str = "cluster.toml") -> str:
    """A two-task run that lasts (LIVE), detached; its id once both tasks have trained steps."""
    spec = write_spec(tmp_path, training=f"command = {json.dumps([sys.executable, '-c', LIVE])}", name=name)
    r = cli("up", "--detach", spec, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    snap = wait_for(lambda: (s := status_json(cli)) and all(t["global_step"] and t["samples_per_sec"]
                                                            for t in s["tasks"]) and s,
                    240, "both tasks to train steps and measure samples/s")
    return snap["run_id"]


def scrape(url: str, token: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    code, _, text = get(f"{url}/metrics", token=token)
    assert code == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_of_a_live_run_hold_every_series_per_task_with_steps_increasing(cli, tmp_path):
    run = live_run(cli, tmp_path)
    try:
        with dashboard(cli) as (_, url, _, token):
            steps = [(("run", run), ("task", task)) for task in ("0", "1")]
            first = wait_for(lambda: (s := scrape(url, token)) and all((n, k) in s for n in SERIES for k in steps)
                             and s, 30, "every series of both tasks in /metrics (CPU and memory: a beat's)")
            second = wait_for(lambda: (s := scrape(url, token)) and all(
                s.get(("mgpu_task_step", k), 0) > first.get(("mgpu_task_step", k), 0) for k in steps) and s,
                30, "both tasks' steps to increase in /metrics")
    finally:
        assert cli("down", timeout=120).returncode == 0
    for task in ("0", "1"):
        labels = (("run", run), ("task", task))
        for name in SERIES:
            assert (name, labels) in first and (name, labels) in second, (name, task, sorted(first))
        assert second[("mgpu_task_step", labels)] > first[("mgpu_task_step", labels)], (first, second)
        assert second[("mgpu_task_up", labels)] == 1.0
        assert second[("mgpu_task_state", (("run", run), ("state", "running"), ("task", task)))] == 1.0
    assert second[("mgpu_run_state", (("run", run), ("state", "running")))] == 1.0
    for name in ("mgpu_run_restarts_total", "mgpu_run_preemptions_total"):
        assert second[(name, (("run", run),))] == 0.0


@pytest.fixture
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if IN_CI:
            raise
        pytest.skip("needs playwright: pip install -e '.[test]' (runs always under CI=true)")
    if not shutil.which(CHROMIUM) and not IN_CI:
        pytest.skip(f"needs {CHROMIUM}: apt-get install -y chromium (runs always under CI=true)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.mark.browser
def test_two_dashboards_on_one_host_each_keep_their_own_token(tmp_path, browser):
    """Opening a second dashboard (another port, another user's, say) neither logs the first out nor is sent its
    token: each page sends its own token, to its own port, and nothing else."""
    one, two = Cli(tmp_path / "one", tmp_path), Cli(tmp_path / "two", tmp_path)
    with dashboard(one) as (_, url1, port1, token1), dashboard(two) as (_, url2, port2, token2):
        context = browser.new_context()
        sent = []
        context.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"), r.headers.get("cookie"))))
        first, second = context.new_page(), context.new_page()
        first.goto(f"{url1}/?token={token1}")
        second.goto(f"{url2}/?token={token2}")
        for page, url in ((first, url1), (second, url2), (first, url1)):  # the first again, after the second
            page.goto(url + "/")  # no token in the URL: the page kept its own
            wait_for(lambda: "0 run(s)" in page.inner_text("#count"), 10, f"{url}'s runs listed")
            assert page.inner_text("#problem") == "", page.inner_text("#problem")
        context.close()
    mine = {f":{port1}/": token1, f":{port2}/": token2}
    for where, authorization, cookie in sent:
        token = next(t for p, t in mine.items() if p in where)
        assert cookie is None and authorization in (None, f"Bearer {token}"), (where, authorization, cookie)
    assert any(a == f"Bearer {token1}" for _, a, _ in sent) and any(a == f"Bearer {token2}" for _, a, _ in sent)


def steps_on_screen(page) -> list[int]:
    """Both tasks' steps done, as the page shows them now (-1 while not known)."""
    texts = [page.inner_text(f'[data-task="{i}"] .global-step') if page.query_selector(f'[data-task="{i}"]') else ""
             for i in (0, 1)]
    return [int(t) if t.isdigit() else -1 for t in texts]


@pytest.mark.browser
def test_a_live_runs_page_moves_draws_and_shows_a_killed_task_failed_within_3_s(cli, tmp_path, browser):
    run = live_run(cli, tmp_path, name=MARKUP)  # what the records hold is shown as text, never run as markup
    try:
        with dashboard(cli) as (_, url, _, token):
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}/?token={token}")  # the URL it printed; the page keeps the token, the URL bar drops it
            assert page.url == url + "/", page.url
            page.wait_for_selector(f'[data-run="{run}"]', timeout=10_000)
            assert "running" in page.inner_text(f'[data-run="{run}"]') and MARKUP in page.inner_text("body")
            assert not page.query_selector("img") and page.title() != "pwned"

            page.click(f'a[href="/runs/{run}"]')
            # polled from here: the page's policy (no eval) stops Playwright's in-page wait_for_function
            before = wait_for(lambda: min(s := steps_on_screen(page)) > 0 and s, 15, "both tasks' steps on screen")
            wait_for(lambda: all(a > b for a, b in zip(steps_on_screen(page), before)), 15,
                     f"both tasks' steps to increase on screen from {before}")
            wait_for(lambda: page.evaluate("[...document.querySelectorAll('svg.chart path.line')]"
                                           ".some((p) => (p.getAttribute('d') || '').split('L').length > 3)"),
                     15, "a chart's line drawn")
            for width in (1280, 390):  # a desktop and a phone
                page.set_viewport_size({"width": width, "height": 900})
                for wait in (50, 1500):  # at once (charts drawn wider are scaled), and once a refresh drew them
                    page.wait_for_timeout(wait)
                    scroll, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
                    assert scroll <= inner, f"the page overflows at {width} px ({wait} ms): {scroll} > {inner}"
                assert page.is_visible('[data-task="1"] .task-state')

            assert MARKUP in page.inner_text("#facts") and not page.query_selector("img")
            page.click("#stacks-button")  # py-spy on each task's host, through the engine
            try:
                wait_for(lambda: len(page.query_selector_all("#stacks pre")) == 2, 60, "both tasks' stacks")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the page shows: {page.inner_text('#stacks')!r}") from None
            assert all(t.startswith("task ") and STACK_HEADER.search(t) for t in page.locator("#stacks pre").all_inner_texts())

            pid = status_json(cli, run)["tasks"][1]["pid"]
            os.kill(pid, signal.SIGKILL)  # task 1's training process
            killed = time.monotonic()
            wait_for(lambda: page.inner_text('[data-task="1"] .task-state') == "failed", 10, "task 1 shown failed")
            took = time.monotonic() - killed
            assert took < 3.0, f"task 1 shown failed {took:.1f} s after kill -9"
            # ended mid-epoch: its final figures say which epoch validation's are of (the last that ended)
            group = wait_for(lambda: (s := status_json(cli, run))["state"] == "failed" and s["group"], 60, "the end")
            page.wait_for_selector("#final .final", timeout=15_000)
            final = page.inner_text("#final")
            assert f"epoch {group['epoch']}/{group['epochs']}" in final, (final, group)
            if group["step"] < group["steps_per_epoch"] and group["ended_epoch"]:  # (a kill at an epoch's end: none)
                assert f"(epoch {group['ended_epoch']})" in final and group["ended_epoch"] < group["epoch"], final

            # a failure told by its cause: the exception raised in the user's model, and a refused run's reason
            failed, where = raising_run(cli, tmp_path)
            page.goto(f"{url}/runs/{failed}")
            wait_for(lambda: page.query_selector("#failure .cause"), 15, "the failure's cause on the page")
            assert page.inner_text("#failure .cause") == f"ValueError: Net wants 3 channels, got 1 at {where}, in call"
            assert "Around it in its log" in page.inner_text("#failure")
            refused, holder = refused_run(cli, tmp_path)
            page.goto(f"{url}/runs/{refused}")
            wait_for(lambda: f"in use by pid {holder}" in page.inner_text("#failure"), 15, "the refusal's reason shown")
            assert not errors, errors
    finally:
        cli("down", timeout=120)


RAISES = """from worker import import_keras
from worker.examples.digits import task as digits


def model():
    keras = import_keras()

    class Net(keras.Model):  # built in fit: its call runs traced, in the first step
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(10, activation="softmax")

        def call(self, inputs):
            if inputs.shape[-1] != 3:
                raise ValueError(f"Net wants 3 channels, got {inputs.shape[-1]}")
            return self.dense(inputs)

    return Net()


def task():
    t = digits()
    t.model, t.epochs = model, 1
    return t
"""


def raising_run(cli: Cli, tmp_path) -> tuple[str, str]:
    """A two-task run whose model raises ValueError in its call, deep inside fit: its id and the raising line
    (file:line), once `up` told the cause first in its closing paragraph and `status --json` gives it as fields."""
    (tmp_path / "raises.py").write_text(RAISES)
    line = next(n for n, text in enumerate(RAISES.splitlines(), 1) if "raise ValueError" in text)
    where = f"{tmp_path / 'raises.py'}:{line}"
    spec = write_spec(tmp_path, 'entrypoint = "raises:task"', extra=f'workdir = "{tmp_path}"\n', name="raises.toml")
    r = cli("up", spec, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    said = r.stderr[r.stderr.index("error: "):]
    assert said.startswith("error: task ") and (f"exited with code 1: ValueError: Net wants 3 channels, got 1 (at "
                                                f"{where}, in call). Every other task was stopped.") in said, said
    failure = status_json(cli)["failure"]
    cause = failure["cause"]
    assert (cause["exception"], cause["message"], f"{cause['file']}:{cause['line']}", cause["function"]) == (
        "ValueError", "Net wants 3 channels, got 1", where, "call"), failure
    assert any("raise ValueError" in x for x in cause["lines"]) and "Around it in its log" in failure["message"]
    return status_json(cli)["run_id"], where


def refused_run(cli: Cli, tmp_path) -> tuple[str, int]:
    """A run its preflight refused (its port is held by this process): its id and the holder's pid."""
    return shared_runs.refused_run(cli, tmp_path), os.getpid()
