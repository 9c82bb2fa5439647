"""The run page's parts a person keeps it open for, in a real Chromium at 1280 and 390 px, and /metrics parsed:
per-task CPU and memory, an ended run's final figures at the top, the spec it ran (secrets masked), loss on a
log axis and val_loss with it, the start-up compressed as in the PNG, TensorFlow's start-up chatter hidden from
the logs, nothing about stragglers or stacks on a refused run. One short real digits run serves every check."""

from __future__ import annotations

import re

import pytest

from shared_runs import DIGITS_EPOCHS, SECRET
from test_dashboard import browser, dashboard, get, scrape  # noqa: F401 (browser: a fixture)
from launcher.run.screen import is_noise


@pytest.fixture(scope="module")
def ended(digits_run, refused_run_id):
    """The session's digits run (DIGITS_EPOCHS epochs, succeeded, TensorFlow's C++ log on, a secret in its env),
    and a refused run beside it: (cli, run id, refused run id)."""
    return digits_run.cli, digits_run.run_id, refused_run_id


def test_the_api_gives_final_figures_and_the_spec_masked_and_logs_without_chatter(ended):
    cli, run, _ = ended
    with dashboard(cli) as (_, url, _, token):
        code, _, body = get(f"{url}/api/runs/{run}", token=token)
        assert code == 200, body
        import json

        snap = json.loads(body)
        final = snap["final"]
        assert (final["epoch"], final["epochs"]) == (DIGITS_EPOCHS, DIGITS_EPOCHS) and final["loss"] > 0, final
        assert "val_loss" in final["metrics"] and "accuracy" in final["metrics"], final
        assert SECRET not in body and 'MY_API_TOKEN = "****"' in snap["spec_text"], snap["spec_text"]
        assert 'entrypoint = "paced:task"' in snap["spec_text"]
        assert all(t["cpu_percent"] is not None and t["rss"] > 0 for t in snap["tasks"]), snap["tasks"]

        code, _, body = get(f"{url}/api/runs/{run}/logs", token=token)
        tails = json.loads(body)
        assert all(t["lines"] and not any(is_noise(x) for x in t["lines"]) for t in tails), tails
        log = (next((cli.home / "runs" / run).glob("**/task-0/worker.log"))).read_text()
        assert any(is_noise(x) for x in log.splitlines()), "the log has TensorFlow's C++ lines (the level is 0)"

        series = json.loads(get(f"{url}/api/runs/{run}/series", token=token)[2])
        ts, xs = series["axis"]  # the PNG's knots: start-up takes most of a short run, compressed to 12 %
        from launcher.diagnose import report

        assert series["axis"] == list(report.knots(series["startups"], series["until"]))


def test_metrics_give_epoch_loss_cpu_memory_and_states(ended):
    cli, run, _ = ended
    with dashboard(cli) as (_, url, _, token):
        seen = scrape(url, token)
    for task in ("0", "1"):
        labels = (("run", run), ("task", task))
        assert seen[("mgpu_task_epoch", labels)] == DIGITS_EPOCHS, sorted(seen)
        assert seen[("mgpu_task_loss", labels)] > 0
        assert seen[("mgpu_task_cpu_percent", labels)] >= 0 and seen[("mgpu_task_memory_bytes", labels)] > 2**20
        states = {dict(k[1])["state"]: v for k, v in seen.items() if k[0] == "mgpu_task_state"
                  and dict(k[1])["task"] == task and dict(k[1])["run"] == run}
        assert states["succeeded"] == 1.0 and sum(states.values()) == 1.0 and "starting" in states, states
    runs = {dict(k[1])["state"]: v for k, v in seen.items() if k[0] == "mgpu_run_state" and dict(k[1])["run"] == run}
    assert runs["succeeded"] == 1.0 and sum(runs.values()) == 1.0, runs


@pytest.mark.browser
def test_the_page_at_1280_and_390_px(ended, browser):  # noqa: F811
    cli, run, refused = ended
    with dashboard(cli) as (_, url, _, token):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{url}/?token={token}")
        page.goto(f"{url}/runs/{run}")
        page.wait_for_selector("#final .final", timeout=15_000)
        final = page.inner_text("#final")
        sig = r"\d\.?\d*(e[+-]\d\d)?"  # 4 significant digits, as the console's epoch line (.4g)
        assert re.search(rf"epoch {DIGITS_EPOCHS}/{DIGITS_EPOCHS} · loss {sig} · accuracy {sig}", final) and "val_loss" in final, final
        page.wait_for_selector('[data-task="1"] .memory', timeout=15_000)
        for i in (0, 1):
            assert re.fullmatch(r"\d+", page.inner_text(f'[data-task="{i}"] .cpu')), page.inner_text("#tasks")
            assert re.fullmatch(r"\d+ MB", page.inner_text(f'[data-task="{i}"] .memory'))
        page.wait_for_selector("svg.chart rect.startup", timeout=15_000)  # the start-up, compressed and shaded
        loss = page.locator("figure.chart-box", has_text="val_loss")
        assert "loss per epoch" in loss.inner_text() and loss.count() == 1  # val_loss drawn with the loss

        def ticks() -> list[str]:
            return loss.locator("svg g.axes text").all_text_contents()  # an SVG text has no innerText

        linear = ticks()
        page.check("#loss-log")
        for _ in range(50):  # redrawn at once; a loaded machine may take a while
            if ticks() != linear:
                break
            page.wait_for_timeout(200)
        assert "on a log axis" in loss.inner_text() and ticks() != linear, (linear, ticks())

        assert not page.is_visible("#stacks-section")  # an ended run has no task to take stacks of
        page.click("#spec-box summary")
        spec = page.inner_text("#spec")
        assert 'MY_API_TOKEN = "****"' in spec and SECRET not in page.content(), spec
        page.wait_for_selector('[data-log="0"] pre', timeout=15_000)
        logs = page.inner_text("#logs")
        assert "start-up chatter not shown" in logs and not any(is_noise(x) for x in logs.splitlines()), logs
        for width in (1280, 390):
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_timeout(2500)  # a refresh draws the charts at the new width
            scroll, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert scroll <= inner, f"the page overflows at {width} px: {scroll} > {inner}"
            assert page.is_visible("#final") and page.is_visible('[data-task="1"] .memory')
            page.screenshot(path=str(cli.cwd / f"run-page-{width}.png"), full_page=True)

        page.goto(f"{url}/runs/{refused}")
        page.wait_for_selector("#failure .failure", timeout=15_000)
        page.wait_for_timeout(1200)
        assert not page.is_visible("#stacks-section") and page.inner_text("#straggler") == ""
        assert "straggler" not in page.inner_text("body") and "Take stacks" not in page.inner_text("body")
        assert not errors, errors


def test_the_page_lists_each_restart_with_its_phases_as_up_said_them(restart_run, browser):  # noqa: F811
    """The run with a kill -9 and a group restart: its page names the restart's parts (the line `up` printed)."""
    said = re.search(r"mgpu-cluster \| (restart 1 took [^\n]*?)(?:; epoch \d+: saved[^\n]*)?\n", restart_run.out)
    assert said, restart_run.out
    with dashboard(restart_run.cli) as (_, url, _, token):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/?token={token}")
        page.goto(f"{url}/runs/{restart_run.run_id}")
        page.wait_for_selector("#attempts li.restart-phases", timeout=15_000)
        shown = page.inner_text("#attempts li.restart-phases")
        assert shown.startswith("restart 1 took ") and "teardown" in shown and "spawn" in shown, shown
        head = shown.split(", to first step")[0]  # its parts up to the spawn: measured once, told alike
        assert head == said.group(1).split(", to first step")[0] and "to first step" in shown, (shown, said.group(1))


def test_one_run_gives_the_same_figures_in_every_view(digits_run, browser):  # noqa: F811
    """The digits run read from the console, `status` (piped and --json), /metrics, the page and the report's data:
    one training throughput, one step and epoch, one loss, and phases that sum to the run's wall time."""
    from conftest import status_json
    from launcher.diagnose import series

    cli, run, out = digits_run.cli, digits_run.run_id, digits_run.out
    snap, data = status_json(cli, run), series.load(digits_run.record)
    group, last = snap["group"], data["group"]["epochs"][-1]
    line = next(x for x in reversed(out.splitlines()) if x.startswith("task0") and f"| epoch {DIGITS_EPOCHS}/" in x)
    rate, loss = int(line.rsplit("samples/s=", 1)[1]), line.split(" loss=")[1].split()[0]
    piped = cli("status", run, timeout=60).stdout
    with dashboard(cli) as (_first, url, _port, token):
        scraped = scrape(url, token)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/?token={token}")
        page.goto(f"{url}/runs/{run}")
        page.wait_for_selector("#group .group", timeout=15_000)
        page.wait_for_selector("#phases li", timeout=15_000)
        shown, final = page.inner_text("#group"), page.inner_text("#final")
        page_phases = [li.inner_text() for li in page.query_selector_all("#phases li")]
        page.close()
    metric = {name: scraped[(f"mgpu_group_{name}", (("run", run),))] for name in
              ("samples_per_second", "step", "epoch", "loss")}

    # throughput: the console's last epoch line (the chief's), the report's bar, status, /metrics and the page
    assert group["task"] == 0 and round(last["samples_per_s"]) == round(group["samples_per_sec"]) == rate, (last, group, line)
    assert metric["samples_per_second"] == group["samples_per_sec"], (metric, group)
    assert f"{rate} samples/s" in piped and f"samples/s {rate}" in shown and f"samples/s {rate}" in final, (piped, shown)
    # step and epoch: the group's, with no task behind at the end
    assert (group["epoch"], group["step"]) == (DIGITS_EPOCHS, group["steps_per_epoch"]), group
    assert metric["step"] == group["global_step"] and metric["epoch"] == DIGITS_EPOCHS, metric
    assert [t["behind"] for t in snap["tasks"]] == [0, 0], snap["tasks"]
    assert f"global step {group['global_step']}" in piped and f"global step {group['global_step']}" in shown
    # loss: 4 significant digits everywhere
    assert f"{group['loss']:.4g}" == f"{last['loss']:.4g}" == loss and metric["loss"] == group["loss"], (group, loss)
    assert f"loss {loss}," in piped and f"loss {loss} ·" in shown and f"loss {loss} ·" in final, (piped, shown, final)

    # phases: each an interval after the one before, summing to the run's wall time in every view
    spans = [(p["name"], p["end"] - p["start"]) for p in data["phases"]]
    assert [n for n, _ in spans] == ["preflight", "setup", "spawn", "to first step", "training", "teardown"], spans
    assert all(a["end"] == b["start"] for a, b in zip(data["phases"], data["phases"][1:])), data["phases"]
    said = next(x for x in out.splitlines() if "| phases: " in x)
    parts = dict(re.findall(r"([a-z ]+?) (\d+\.\d) s(?:,|:)", said.split("phases: ", 1)[1]))
    total = float(re.search(r": (\d+\.\d) s in all", said).group(1))
    assert f"succeeded in {total:.1f} s" in out, (said, out[-300:])
    assert {n: f"{s:.1f}" for n, s in spans} == {n.strip(): v for n, v in parts.items()}, (spans, said)
    assert abs(sum(s for _, s in spans) - total) <= 0.06, (spans, total)
    assert [x.split(" (")[-1] for x in page_phases] == [f"{s:.1f} s)" for _, s in spans], (page_phases, spans)
