"use strict";
// The runs page: every recorded run, newest first, as `mgpu-cluster ls` lists them.

function runRow(run) {
  const link = el("a", { href: `/runs/${encodeURIComponent(run.run_id)}`, text: run.run_id });
  return el("tr", { "data-run": run.run_id },
    el("td", {}, link),
    el("td", {}, stateBadge(run.state)),
    el("td", { class: "wrap", text: run.spec || run.why || "" }),
    el("td", { text: run.engine || "" }),
    el("td", { text: fmt.of(run.tasks) }),
    el("td", { text: fmt.clock(run.started_at) }),
    el("td", { text: fmt.duration(run.duration_s) }));
}

async function refresh() {
  const problem = document.getElementById("problem");
  try {
    const { runs, total } = await getJson("/api/runs");
    document.getElementById("count").textContent = runs.length < total
      ? `the newest ${runs.length} of ${total} runs ('mgpu-cluster ls' lists every run)`
      : `${total} run(s), newest first`;
    fillTable(document.getElementById("runs"), runs.map(runRow));
    showError(problem, null);
  } catch (error) {
    showError(problem, error);
  }
}

poll(refresh, 2000);
