"""The server's status page, GET /: the model and its labels, live traffic (from /metrics), the monitor's signals
against their thresholds (/v1/monitor), and a box to try a text (/v1/predict). One HTML document, its script and
style inline (no build step, no asset from anywhere else: the Content-Security-Policy of app.py allows this
server only); every value from the server is set as text, never as markup.
"""

from __future__ import annotations

import html

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>torchloom: {name}</title><link rel="icon" href="data:,">
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 980px; padding: 1rem; color: #1d2330; }}
h1 {{ font-size: 1.35rem; margin: .2rem 0; }} h2 {{ font-size: 1.05rem; margin: 1.4rem 0 .4rem; }}
.muted {{ color: #667; }} .row {{ display: flex; gap: .8rem; flex-wrap: wrap; }}
.card {{ border: 1px solid #d6dae3; border-radius: 6px; padding: .5rem .8rem; min-width: 9rem; }}
.card b {{ display: block; font-size: 1.25rem; }}
table {{ border-collapse: collapse; width: 100%; }} td, th {{ text-align: left; padding: .25rem .5rem;
  border-bottom: 1px solid #eceef3; }}
.bar {{ position: relative; height: .8rem; background: #eef0f5; border-radius: 3px; min-width: 10rem; }}
.bar i {{ position: absolute; left: 0; top: 0; bottom: 0; background: #4c9a5b; border-radius: 3px; }}
.bar i.bad {{ background: #c8463c; }} .bar s {{ position: absolute; top: -2px; bottom: -2px; width: 2px;
  background: #1d2330; }}
.state {{ display: inline-block; padding: .1rem .6rem; border-radius: 1rem; background: #eef0f5; }}
.state.drift {{ background: #f6d5d2; }} .state.no_drift {{ background: #d7eedb; }}
textarea {{ width: 100%; min-height: 4.5rem; font: inherit; box-sizing: border-box; }}
input {{ font: inherit; }} button {{ font: inherit; padding: .3rem 1rem; }}
</style></head>
<body>
<h1 id="model">{name}</h1>
<div class="muted">version <span id="version">{version}</span> &middot; labels: <span id="labels">{labels}</span></div>

<h2>Traffic</h2>
<div class="row">
 <div class="card">texts / s<b id="throughput">-</b></div>
 <div class="card">requests / s<b id="requests">-</b></div>
 <div class="card">p50 latency<b id="p50">-</b></div>
 <div class="card">p99 latency<b id="p99">-</b></div>
 <div class="card">queued texts<b id="queue">-</b></div>
 <div class="card">errors (5xx)<b id="errors">-</b></div>
</div>

<div id="fleet" hidden><h2>Models</h2>
<table id="models"><thead><tr><th>model</th><th>version</th><th>traffic</th><th>monitor</th>
<th>accuracy on feedback</th><th>against the first</th></tr></thead><tbody></tbody></table></div>

<h2>Monitor <span id="state" class="state">-</span></h2>
<div id="reason" class="muted"></div>
<div class="row">
 <div class="card">texts in the window<b id="window">-</b></div>
 <div class="card">estimated accuracy<b id="accuracy">-</b><span id="interval" class="muted"></span></div>
</div>
<table id="signals"><thead><tr><th>signal</th><th>distance</th><th>threshold</th><th>against its threshold</th>
</tr></thead><tbody></tbody></table>
<h2>Class shares</h2>
<table id="shares"><thead><tr><th>label</th><th>recent texts</th><th>reference</th></tr></thead><tbody></tbody></table>
<h2>History</h2>
<table id="history"><thead><tr><th>period (UTC)</th><th>texts</th><th></th><th>verdict</th>
<th>estimated accuracy</th></tr></thead><tbody></tbody></table>

<h2>Try a text</h2>
<form id="try"><textarea id="text" placeholder="Type or paste a text"></textarea>
<div class="row" style="align-items:center; margin-top:.4rem"><button id="send" type="submit">Predict</button>
<input id="key" type="password" placeholder="API key, if the server needs one" autocomplete="off" size="32"></div>
</form>
<div id="answer" style="margin-top:.5rem"></div>

<script nonce="{nonce}">
"use strict";
const $ = (id) => document.getElementById(id);
const keyField = $("key");
keyField.value = sessionStorage.getItem("torchloom-key") || "";
function headers() {{
  const h = {{"Content-Type": "application/json"}};
  if (keyField.value) h["Authorization"] = "Bearer " + keyField.value;
  return h;
}}
function parseMetrics(text) {{
  const out = [];
  for (const line of text.split("\\n")) {{
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\\w:]*)(?:\\{{(.*)\\}})?\\s+(\\S+)/);
    if (!m) continue;
    const labels = {{}};
    for (const part of (m[2] || "").matchAll(/(\\w+)="((?:[^"\\\\]|\\\\.)*)"/g)) labels[part[1]] = part[2];
    out.push({{name: m[1], labels: labels, value: Number(m[3])}});
  }}
  return out;
}}
const PREDICT = ["/v1/predict", "/predict"];
function totals(samples) {{
  const t = {{texts: 0, requests: 0, errors: 0, queue: 0, buckets: {{}}, recent: {{}}}};
  for (const s of samples) {{
    if (s.name === "torchloom_texts_total") t.texts = s.value;
    else if (s.name === "torchloom_request_duration_recent_seconds") t.recent[s.labels.quantile] = s.value;
    else if (s.name === "torchloom_queue_depth") t.queue = s.value;
    else if (s.name === "torchloom_requests_total") {{
      if (PREDICT.includes(s.labels.endpoint)) t.requests += s.value;
      if (s.labels.status && s.labels.status[0] === "5" && s.labels.endpoint !== "/readyz") t.errors += s.value;
    }} else if (s.name === "torchloom_request_duration_seconds_bucket" && PREDICT.includes(s.labels.endpoint)) {{
      t.buckets[s.labels.le] = (t.buckets[s.labels.le] || 0) + s.value;
    }}
  }}
  return t;
}}
function quantile(now, before, q) {{
  const les = Object.keys(now.buckets).sort((a, b) => Number(a) - Number(b));
  const count = (le) => now.buckets[le] - ((before && before.buckets[le]) || 0);
  const all = les.length ? count(les[les.length - 1]) : 0;
  if (!all) return "-";
  let below = 0, lower = 0;
  for (const le of les) {{
    const c = count(le);
    if (c >= q * all) {{  // within the bucket, as Prometheus' histogram_quantile reads it
      if (le === "+Inf") return "> " + ms(lower);
      return "\\u2248 " + ms(lower + (Number(le) - lower) * (q * all - below) / Math.max(1, c - below));
    }}
    below = c; lower = Number(le);
  }}
  return "-";
}}
function latency(now, previous, q) {{  // measured by the server over its last minute; else from the histogram
  return now.recent.count ? ms(now.recent[String(q)]) : quantile(now, previous, q);
}}
function ms(seconds) {{ return seconds < 1 ? Math.round(seconds * 1000) + " ms" : seconds.toFixed(1) + " s"; }}
let previous = null;
async function traffic() {{
  const response = await fetch("/metrics");
  if (!response.ok) return;
  const now = totals(parseMetrics(await response.text()));
  now.at = performance.now();
  $("queue").textContent = now.queue;
  $("errors").textContent = now.errors;
  if (previous) {{
    const dt = (now.at - previous.at) / 1000;
    $("throughput").textContent = ((now.texts - previous.texts) / dt).toFixed(1);
    $("requests").textContent = ((now.requests - previous.requests) / dt).toFixed(1);
    $("p50").textContent = latency(now, previous, 0.5);
    $("p99").textContent = latency(now, previous, 0.99);
  }}
  previous = now;
}}
function cell(row, text) {{ const td = row.insertCell(); td.textContent = text; return td; }}
function fmt(x) {{ return x === null || x === undefined ? "-" : Number(x).toFixed(4); }}
async function monitor() {{
  const response = await fetch("/v1/monitor", {{headers: headers()}});
  if (response.status === 401) {{ $("reason").textContent = "enter the API key below to see the monitor"; return; }}
  if (!response.ok) return;
  const r = await response.json();
  const state = $("state");
  state.textContent = r.state.replace("_", " ") + (r.drifted && r.drifted.length ? ": " + r.drifted.join(", ") : "")
    + (r.stale ? " (stale)" : "");
  state.className = "state " + r.state;
  $("reason").textContent = r.reason || r.stale_reason || (r.state === "warming_up" ? "waiting for " + (r.window ?
    r.window.min_texts : "more") + " texts before a verdict" : "");
  history(r.history || []);
  models(r.models, r.verdicts || []);
  $("window").textContent = r.texts === undefined ? "-" : r.texts;
  const est = r.estimated_accuracy;
  $("accuracy").textContent = est ? est.value.toFixed(3) : "-";
  $("interval").textContent = est ? "95 % interval " + est.low.toFixed(3) + " to " + est.high.toFixed(3) +
    (est.reference !== null ? "; reference " + est.reference : "") +
    (est.caveat ? "; under this drift it may be far off: check it with labels" : "") : "";
  const body = $("signals").tBodies[0];
  body.replaceChildren();
  for (const [name, s] of Object.entries(r.signals || {{}})) {{
    const row = body.insertRow();
    row.dataset.signal = name;
    cell(row, name); cell(row, fmt(s.distance)); cell(row, fmt(s.threshold));
    const bar = document.createElement("div"); bar.className = "bar";
    const fill = document.createElement("i");
    const top = Math.max(s.distance, (s.threshold || 0) * 1.5, 1e-9);
    fill.style.width = (100 * s.distance / top) + "%";
    if (s.drift) fill.className = "bad";
    bar.append(fill);
    if (s.threshold !== null) {{
      const mark = document.createElement("s"); mark.style.left = (100 * s.threshold / top) + "%"; bar.append(mark);
    }}
    row.insertCell().append(bar);
  }}
  const shares = $("shares").tBodies[0];
  shares.replaceChildren();
  for (const [label, s] of Object.entries(r.class_shares || {{}})) {{
    const row = shares.insertRow();
    cell(row, label); cell(row, (100 * s.window).toFixed(1) + " %"); cell(row, (100 * s.reference).toFixed(1) + " %");
  }}
}}
function models(all, verdicts) {{  // several models behind the endpoint: each one's part (none: hidden)
  $("fleet").hidden = !all || Object.keys(all).length < 2;
  const body = $("models").tBodies[0];
  body.replaceChildren();
  for (const [name, m] of Object.entries(all || {{}})) {{
    const row = body.insertRow();
    row.dataset.model = name;
    cell(row, name + (m.name !== name ? " (" + m.name + ")" : "")); cell(row, m.version);
    cell(row, m.shadow ? "shadow" : m.traffic + " %");
    const s = m.monitor || {{}};
    cell(row, (s.state || "-").replace("_", " ") + (s.drifted && s.drifted.length ? ": " + s.drifted.join(", ") : "")
      + (s.stale ? " (stale)" : ""));
    const a = m.online_accuracy;
    cell(row, a ? a.value.toFixed(3) + " (" + a.low.toFixed(3) + " to " + a.high.toFixed(3) + ", " + a.labels +
      " labels)" : "-");
    const v = verdicts.find((x) => x.model === name);
    cell(row, v ? v.line : "-");
  }}
}}
function history(periods) {{  // one row a period, newest first, its texts drawn against the busiest one's
  const body = $("history").tBodies[0];
  body.replaceChildren();
  const most = Math.max(1, ...periods.map((h) => h.texts));
  for (const h of [...periods].reverse()) {{
    const row = body.insertRow();
    const start = new Date(h.start * 1000).toISOString().slice(0, 16).replace("T", " ");
    cell(row, start + (h.open ? " (now)" : "")); cell(row, h.texts);
    const bar = document.createElement("div"); bar.className = "bar";
    const fill = document.createElement("i"); fill.style.width = (100 * h.texts / most) + "%";
    if (h.drift_seen) fill.className = "bad";
    bar.append(fill); row.insertCell().append(bar);
    const verdict = h.drift_seen ? "drift in " + h.drifted.join(", ") : (h.state || "-").replace("_", " ");
    cell(row, verdict + (h.stale ? " (stale)" : ""));
    cell(row, h.estimated_accuracy === null || h.estimated_accuracy === undefined ? "-" :
      Number(h.estimated_accuracy).toFixed(3));
  }}
}}
async function refresh() {{
  try {{ await Promise.all([traffic(), monitor()]); }} catch (e) {{ $("reason").textContent = "server unreachable"; }}
}}
$("try").addEventListener("submit", async (event) => {{
  event.preventDefault();
  sessionStorage.setItem("torchloom-key", keyField.value);
  const answer = $("answer");
  answer.textContent = "...";
  const response = await fetch("/v1/predict", {{method: "POST", headers: headers(),
    body: JSON.stringify({{texts: [$("text").value]}})}});
  const body = await response.json();
  answer.replaceChildren();
  if (!response.ok) {{ answer.textContent = body.error ? body.error.message : "error " + response.status; return; }}
  const p = body.predictions[0];
  const head = document.createElement("div");
  const label = document.createElement("b"); label.id = "label"; label.textContent = p.label;
  head.append(label, " (" + (100 * p.score).toFixed(1) + " %)");
  answer.append(head);
  const table = document.createElement("table");
  for (const [name, value] of Object.entries(p.probabilities).sort((a, b) => b[1] - a[1])) {{
    const row = table.insertRow(); cell(row, name); cell(row, (100 * value).toFixed(1) + " %");
  }}
  answer.append(table);
}});
refresh();
setInterval(refresh, 2000);
</script>
</body></html>
"""


def render_page(identity, nonce: str) -> str:
    """The page for a model (serve/model.ModelIdentity); `nonce`: the one the response's policy allows."""
    return _PAGE.format(name=html.escape(identity.name), version=html.escape(identity.version),
                        labels=html.escape(", ".join(identity.labels)), nonce=html.escape(nonce))
