"use strict";
// Shared by both pages. Everything read from a run's records and logs is untrusted: it reaches the page as
// text (textContent, attribute values), never as markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function el(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

function svg(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

// The dashboard's token: given once in the URL it printed, then kept in this origin's storage (its own host
// and port: no other dashboard ever sees it) and sent as a header; the URL bar drops it at once.
const TOKEN_KEY = "mgpu-dashboard-token";
const TOKEN = (() => {
  const given = new URLSearchParams(location.search).get("token");
  if (given) {
    localStorage.setItem(TOKEN_KEY, given);
    history.replaceState(null, "", location.pathname);
  }
  return localStorage.getItem(TOKEN_KEY) || "";
})();

async function getJson(url, options = {}) {
  const headers = { ...(options.headers || {}), Authorization: `Bearer ${TOKEN}` };
  const response = await fetch(url, { cache: "no-store", credentials: "omit", ...options, headers });
  if (response.status === 401) {
    throw new Error("this dashboard asks for its token: open the URL that 'mgpu-cluster dashboard' printed " +
                    "(it is new at each start)");
  }
  let body;
  try {
    body = await response.json();
  } catch (_) {
    body = { error: `${response.status} ${response.statusText}` };
  }
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

// Call `step` now and again `every` ms after each call ends (never two at once), or twice as long as the call
// took when that is longer: a long run's history is read whole, so its page never keeps the server busy.
function poll(step, every) {
  let timer = null;
  const again = async () => {
    const started = performance.now();
    try {
      await step();
    } finally {
      timer = setTimeout(again, Math.max(every, 2 * (performance.now() - started)));
    }
  };
  again();
  return () => clearTimeout(timer);
}

function showError(where, error) {
  where.replaceChildren(error ? el("p", { class: "error", text: String(error.message || error) }) : "");
}

const fmt = {
  num(x, digits = 0) {
    return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
  },
  duration(s) {
    if (typeof s !== "number" || !isFinite(s)) return "–";
    s = Math.max(0, Math.round(s));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
  },
  clock(t) {  // seconds since the epoch -> local date and time
    return typeof t === "number" ? new Date(t * 1000).toLocaleString() : "–";
  },
  sig(x, digits = 4) {  // a loss or metric: `digits` significant digits, as Python's "{:.4g}" (console, status)
    if (typeof x !== "number" || !isFinite(x)) return "–";
    const [mantissa, power] = x.toExponential(digits - 1).split("e");
    const e = Number(power);
    if (e < -4 || e >= digits) {
      return `${mantissa.replace(/\.?0+$/, "")}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
    }
    const fixed = x.toFixed(Math.max(0, digits - 1 - e));
    return fixed.includes(".") ? fixed.replace(/\.?0+$/, "") : fixed;
  },
  of(a, b) {
    return a === null || a === undefined ? "–" : b ? `${a}/${b}` : String(a);
  },
};

function stateBadge(state) {
  return el("span", { class: `state state-${String(state).replace(/[^a-z]/g, "")}`, text: state });
}

// Put `rows` in `body`, each cell labelled with its column's heading (a narrow screen shows rows as cards).
function fillTable(body, rows) {
  const names = [...body.closest("table").querySelectorAll("thead th")].map((th) => th.textContent);
  for (const row of rows) [...row.children].forEach((td, i) => td.setAttribute("data-label", names[i] || ""));
  body.replaceChildren(...rows);
}
