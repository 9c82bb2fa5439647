"use strict";
// One run's page: its tasks (polled every second), its charts and timeline (the run's series, the same data
// as its PNG report), each task's log tail, and the stacks button.

const RUN = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop());
const $ = (id) => document.getElementById(id);
let runEnded = false;
let lastSeries = null;

function splitBar(compute, wait) {
  if (typeof compute !== "number" || typeof wait !== "number") return el("span", { text: "–" });
  const total = compute + wait || 1;
  const own = el("span", { class: "own" }), waiting = el("span", { class: "waiting" });
  own.style.width = `${(100 * compute) / total}%`;
  waiting.style.width = `${(100 * wait) / total}%`;
  return el("span", { class: "split", title: "own work | waiting for the others, per step" },
    el("span", { class: "bar" }, own, waiting),
    el("span", { class: "split-text", text: `${fmt.num(compute, 1)} | ${fmt.num(wait, 1)} ms` }));
}

function seconds(s) {
  return typeof s === "number" ? `${fmt.num(s, 1)} s` : "–";
}

function megabytes(bytes) {
  return typeof bytes === "number" ? `${fmt.num(bytes / 2 ** 20)} MB` : "–";
}

function gibibytes(mib) {
  return typeof mib === "number" ? fmt.num(mib / 1024, 1) : "–";
}

// The task's own GPUs (its CUDA_VISIBLE_DEVICES) as nvidia-smi tells them, device-wide (relayed by its supervisor):
// one line per GPU, "0: 87% · 12.3/79.6 GiB".
function gpus(list) {
  if (!Array.isArray(list) || !list.length) return el("span", { text: "–" });
  return el("span", { class: "gpus", title: "use · memory used/total, of the whole GPU (nvidia-smi)" },
    list.map((g) => el("span", { text: `${g.index}: ${typeof g.util === "number" ? `${g.util}%` : "–"} · ` +
                                       `${gibibytes(g.memory_used)}/${gibibytes(g.memory_total)} GiB` })));
}

function taskRow(t, straggler) {
  const slow = straggler && straggler.task === t.index;
  return el("tr", { "data-task": t.index, class: slow ? "straggler" : null },
    el("td", { text: t.index }),
    el("td", { class: "task-state" }, stateBadge(t.state)),
    el("td", { class: "wrap", text: t.host }),
    el("td", { class: "epoch", text: fmt.of(t.position[0], t.epochs) }),  // a running task's: its group's
    el("td", { class: "step", text: fmt.of(t.position[1], t.steps_per_epoch) }),
    el("td", { class: "global-step", text: fmt.of(t.global_step) }),
    el("td", { class: "behind", text: fmt.of(t.behind) }),
    el("td", { class: "rate", text: fmt.num(t.samples_per_sec) }),
    el("td", { class: "heartbeat", text: seconds(t.heartbeat_age) }),
    el("td", { class: "cpu", text: fmt.num(t.cpu_percent) }),
    el("td", { class: "memory", text: megabytes(t.rss) }),
    el("td", { class: "gpu" }, gpus(t.gpus)),
    el("td", {}, splitBar(t.compute_ms, t.wait_ms)),
    el("td", { text: t.exit_code ?? "" }));
}

function fact(name, value) {
  return [el("dt", { text: name }), el("dd", { text: value })];
}

function figures(g) {  // the group's figures (status --json's group; an ended run's final), as `status` words them
  // mid-epoch, validation's figures are the last ended epoch's: said so
  const of = (k) => k.startsWith("val_") && g.ended_epoch && g.ended_epoch !== g.epoch ? ` (epoch ${g.ended_epoch})` : "";
  const metrics = Object.entries(g.metrics || {}).map(([k, v]) => `${k} ${fmt.sig(v)}${of(k)}`);
  return [`epoch ${fmt.of(g.epoch, g.epochs)}`, `loss ${fmt.sig(g.loss)}`, ...metrics,
          `samples/s ${fmt.num(g.samples_per_sec)}`].join(" · ");
}

function finalBox(f) {  // an ended run's last figures, at the top
  return el("p", { class: "final" }, el("strong", { text: "final: " }), figures(f));
}

function groupBox(g) {  // the group at one moment: the newest record of its tasks
  if (!g) return "";
  return el("p", { class: "group" }, el("strong", { text: "group: " }),
    `${figures(g)} · step ${fmt.of(g.step, g.steps_per_epoch)} · global step ${fmt.of(g.global_step)} ` +
    `(task ${g.task}'s record, the newest: a running task steps with its group and is shown where the group is; ` +
    `its own record is "behind" that many steps, its samples/s its own measure)`);
}

function showStatus(s) {
  $("state").replaceChildren(stateBadge(s.refused ? "refused" : s.state));  // as the runs page says it
  const launcher = s.launcher_alive ? (s.detached ? "running (detached)" : "running") : "gone";
  const end = s.ended_at ?? Date.now() / 1000;
  $("facts").replaceChildren(...[
    fact("engine", s.engine), fact("spec", s.spec), fact("started", fmt.clock(s.created_at)),
    fact("duration", fmt.duration(end - s.created_at)), fact("attempt", s.attempt),
    fact("restarts", s.restarts), fact("preemptions", s.preemptions), fact("launcher", launcher),
    s.start_said ? fact("start", s.start_said) : [],  // "starts fresh" or "resumes run X at epoch N, step S"
  ].flat());
  $("final").replaceChildren(s.final ? finalBox(s.final) : "");
  $("failure").replaceChildren(s.failure ? failureBox(s.failure) : "");
  if ($("spec").textContent !== (s.spec_text || "")) $("spec").textContent = s.spec_text || "the run's copy of its spec cannot be read";
  $("stacks-section").hidden = !!s.refused || ["succeeded", "failed", "stopped", "lost"].includes(s.state);
  $("unrecorded").replaceChildren(s.unrecorded ? el("p", { class: "note", text: s.unrecorded }) : "");
  $("group").replaceChildren(groupBox(s.group));
  fillTable($("tasks"), s.tasks.map((t) => taskRow(t, s.straggler)));
  const st = s.straggler, timed = s.tasks.some((t) => typeof t.compute_ms === "number");
  $("straggler").textContent = st
    ? `straggler: task ${st.task}, its own work per step is ${fmt.num(st.ratio, 2)}x the others' median ` +
      "(the others wait for it)"
    : timed ? "no straggler: every task's own work per step is within 1.25x of the others'" : "";
}

function failureBox(f) {  // its cause first (the exception, the user's own line), then the whole paragraph
  const [said, ...more] = String(f.message || "").split("\n");
  const c = f.cause;
  const where = c && c.file ? ` at ${c.file}:${c.line}${c.function ? `, in ${c.function}` : ""}` : "";
  return el("div", { class: "failure" },
    el("strong", { text: `${f.kind || "failure"}${f.task !== null && f.task !== undefined ? `, task ${f.task}` : ""}` }),
    c ? el("p", { class: "cause" }, el("code", { text: c.message ? `${c.exception}: ${c.message}` : c.exception }),
           where) : "",
    el("p", { class: "wrap", text: said }),
    more.length ? el("pre", { class: "wrap", text: more.join("\n") }) : "");  // the reasons, the lines around it
}

function rest(text) {  // what a reason says after its first line (the last lines of the task's log), whole
  return text ? String(text).split("\n").slice(1).join("\n").trim() : "";
}

function firstLine(text) {  // a reason's own words, without the log lines a failure carries
  const line = String(text).split("\n")[0];
  return line.length > 400 ? `${line.slice(0, 400)}…` : line;
}

function chartBox(title, explain, chart, lines) {
  return el("figure", { class: "chart-box" }, el("figcaption", {}, el("strong", { text: title }), " ", explain),
            chart, lines ? legend(lines) : null);
}

function pointsOf(items, key) {  // [t, value, whether it begins another attempt than the point before]
  const kept = items.filter((p) => typeof p[key] === "number");
  return kept.map((p, i) => [p.t, p[key], i > 0 && p.attempt !== kept[i - 1].attempt]);
}

function showSeries(series, error) {
  lastSeries = [series, error];
  const box = $("charts");
  if (!series || series.refused) {
    const why = series ? "its preflight refused it: nothing was started, so there is nothing to draw" : error;
    box.replaceChildren(el("p", { class: "note", text: why || "no data to draw yet" }));
    return;
  }
  const width = Math.max(280, box.clientWidth - 2);
  const allT = series.tasks.flatMap((t) => t.points.map((p) => p.t));
  const until = largest(allT, Math.max(1, series.until ?? series.end ?? 0));
  const group = series.group || { within: [], epochs: [] };
  const events = (series.events || []).map((e) => ({ t: e.t, kind: e.kind, label: `${e.kind}: ${e.label || ""}` }));
  const marks = [...group.epochs.map((e) => ({ t: e.t, label: `epoch ${e.epoch} ended` })), ...events];

  const rate = [
    { name: "within epochs (recent steps)", colour: colour(0), points: pointsOf(group.within, "samples_per_s") },
    { name: "per epoch (that epoch's own rate)", colour: colour(3), dots: true,
      points: pointsOf(group.epochs, "samples_per_s") },
  ];
  const firstTask = series.tasks.find((t) => t.points.some((p) => typeof p.loss === "number"));
  const metricPoints = (name) => group.epochs.filter((e) => typeof (e.metrics || {})[name] === "number")
    .map((e) => [e.t, e.metrics[name]]);
  const named = [...new Set(group.epochs.flatMap((e) => Object.keys(e.metrics || {})))];
  const losses = named.filter((n) => n.includes("loss")).sort();  // val_loss drawn with the loss, as the report
  const loss = [
    { name: `within epochs (task ${firstTask ? firstTask.index : 0})`, colour: colour(0),
      points: firstTask ? pointsOf(firstTask.points, "loss") : [] },
    { name: "loss per epoch", colour: colour(3), dots: true, points: pointsOf(group.epochs, "loss") },
    ...losses.map((name, i) => ({ name, colour: colour(i + 4), dots: true, points: metricPoints(name) })),
  ];
  const names = named.filter((n) => !n.includes("loss")).sort().slice(0, 8);
  const metrics = names.map((name, i) => ({ name, colour: colour(i + 4 + losses.length), dots: true,
                                           points: metricPoints(name) }));
  const log = $("loss-log").checked, axis = series.axis, startups = series.startups || [];
  const split = series.tasks.flatMap((t) => [
    { name: `task ${t.index} own work`, colour: colour(t.index), points: pointsOf(t.points, "compute_ms") },
    { name: `task ${t.index} waiting`, colour: colour(t.index), dashed: true, points: pointsOf(t.points, "wait_ms") },
  ]);
  const attempts = series.attempts || [];
  box.replaceChildren(...[  // replaceChildren would show a null as the text "null"
    chartBox("samples/s", "the group's training throughput (task 0's measure, as the console's epoch lines), from " +
             "zero; grey lines: epoch ends; dashed, coloured: failures and restarts (no line is drawn across one).",
             timeChart({ width, until, lines: rate, marks, axis, startups }), rate),
    chartBox("loss", `per epoch (val_loss too), and within epochs${log ? ", on a log axis" : ""}.`,
             timeChart({ width, until, lines: loss, marks, log, axis, startups }), loss),
    metrics.length ? chartBox("metrics", "per epoch.", timeChart({ width, until, lines: metrics, marks, axis, startups }),
                              metrics) : null,
    chartBox("per step (ms)", "own work: computing its batch; waiting: for the slowest task, in the all-reduce.",
             timeChart({ width, until, lines: split, axis, startups }), split),
    chartBox("timeline", "phases, attempts (coloured by outcome) and events; hover for reasons.",
             timeline({ width, until, phases: series.phases || [], attempts, events: series.events || [], axis,
                        startups })),
    axis ? el("p", { class: "note", text: "shaded: start-up (preflight, spawn, until the first step; again after " +
                     "each restart), compressed as in the PNG report; the rest is to scale." }) : null,
  ].filter(Boolean));
  $("attempts").replaceChildren(...attempts.map((a) => el("li", {},
    el("strong", { text: `attempt ${a.index}: ${a.outcome || "running"}` }),
    ` ${mmss(a.start ?? 0)}–${typeof a.end === "number" ? mmss(a.end) : "now"}`,
    a.reason ? el("span", { class: "reason", text: ` — ${firstLine(a.reason)}` }) : "",
    rest(a.reason) ? el("pre", { class: "wrap reason-more", text: rest(a.reason) }) : "")),  // its log lines too
    ...(series.events || []).map((e) => el("li", {}, el("strong", { text: e.kind }), ` ${mmss(e.t)} `,
      el("span", { class: "reason", text: e.label || "" }))),
    ...(series.restart_phases || []).map((r) => el("li", { class: "restart-phases", text: r.line })));  // as up said
  $("phases").replaceChildren(...(series.phases || []).map((p) => el("li", {
    text: `${p.name} ${mmss(p.start ?? 0)}–${typeof p.end === "number" ? mmss(p.end) : "now"}` +
          (typeof p.end === "number" && typeof p.start === "number" ? ` (${fmt.num(p.end - p.start, 1)} s)` : ""),
  })));
}

async function refresh() {
  try {
    const status = await getJson(`/api/runs/${encodeURIComponent(RUN)}`);
    showStatus(status);
    runEnded = ["succeeded", "failed", "stopped", "lost"].includes(status.state);
    showError($("problem"), null);
  } catch (error) {
    showError($("problem"), error);
  }
}

async function refreshCharts() {
  try {
    showSeries(await getJson(`/api/runs/${encodeURIComponent(RUN)}/series`), null);
  } catch (error) {
    showSeries(null, error.message);
  }
}

let logsDone = false;
function logBox(index, host) {  // made once per task: a reader's open or closed box and scroll stay as they are
  const id = `log-${index}`;
  let box = document.getElementById(id);
  if (!box) {
    box = el("details", { id, open: true, "data-log": index }, el("summary", { text: `task ${index} (${host})` }),
             el("pre", { class: "log" }));
    $("logs").append(box);
  }
  return box;
}

async function refreshLogs() {
  if (logsDone) return;
  const wasEnded = runEnded;
  try {
    const tails = await getJson(`/api/runs/${encodeURIComponent(RUN)}/logs`);
    for (const t of tails) {
      const pre = logBox(t.index, t.host).querySelector("pre");
      const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.className = t.error ? "log error" : "log";
      const hidden = t.hidden ? `(${t.hidden} line(s) of TensorFlow's start-up chatter not shown, as 'up' hides ` +
                                "them; worker.log has every line)\n" : "";
      pre.textContent = t.error || hidden + t.lines.join("\n");
      if (atEnd) pre.scrollTop = pre.scrollHeight;  // follow the tail, unless the reader scrolled up
    }
    logsDone = wasEnded;  // read once more after the end, then no more
    showError($("logs-problem"), null);
  } catch (error) {
    showError($("logs-problem"), error);
  }
}

async function takeStacks() {
  const button = $("stacks-button"), out = $("stacks");
  button.disabled = true;
  out.replaceChildren(el("p", { class: "note", text: "taking the stacks of every running task (py-spy)…" }));
  try {
    const found = await getJson(`/api/runs/${encodeURIComponent(RUN)}/stacks`,
                                { method: "POST", headers: { "X-Mgpu-Dashboard": "1" } });
    out.replaceChildren(...found.map((s) => el("pre", { class: s.ok ? "log" : "log error", text: s.text })));
  } catch (error) {
    showError(out, error);
  } finally {
    button.disabled = false;
  }
}

document.title = `run ${RUN} · mgpu-cluster`;
$("run-id").textContent = RUN;
$("stacks-button").addEventListener("click", takeStacks);
$("loss-log").addEventListener("change", () => { if (lastSeries) showSeries(...lastSeries); });
poll(refresh, 1000);  // the numbers: a task that fails shows failed within about 2 s
poll(refreshCharts, 2000);  // the charts: the run's whole history, read again
poll(refreshLogs, 3000);
