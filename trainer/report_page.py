"""The HTML template of `lightning-train report` (Jinja2, autoescaped; see trainer/report.py).

Static parts (header, reward curve, step table) are rendered by the template; the rollout list and
the conversation are built by the inline script from the JSON block, with ``textContent`` only (no
``innerHTML`` of data anywhere), so model-written text is always text.
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>{{ run.run_id }} · lightning run report</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d232a; background: #f6f7f9; }
header, section { padding: 12px 20px; }
header { background: #1d2b3a; color: #fff; }
header h1 { margin: 0 0 4px; font-size: 20px; }
header .meta span { margin-right: 18px; opacity: .85; }
h2 { font-size: 16px; margin: 8px 0; }
.card { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 10px 14px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e6e8eb; text-align: right; white-space: nowrap; }
th { position: sticky; top: 0; background: #fafbfc; font-weight: 600; }
td.l, th.l { text-align: left; }
svg .axis { stroke: #9aa3ad; stroke-width: 1; }
svg .grid { stroke: #eceff2; stroke-width: 1; }
svg text { font-size: 11px; fill: #55606b; }
svg .train { stroke: #2f6fb3; fill: none; stroke-width: 2; }
svg .eval { stroke: #d9822b; fill: none; stroke-width: 2; stroke-dasharray: 5 3; }
svg .dot-train { fill: #2f6fb3; } svg .dot-eval { fill: #d9822b; }
#rollouts { display: grid; grid-template-columns: minmax(420px, 42%) 1fr; gap: 14px; align-items: start; }
#rollout-list { max-height: 80vh; overflow: auto; }
#rollout-list tr { cursor: pointer; }
#rollout-list tr.selected td { background: #dbe9f8; }
#rollout-list tr:hover td { background: #eef4fb; }
#filter { width: 100%; box-sizing: border-box; padding: 5px 8px; margin-bottom: 6px; }
.msg { border-left: 4px solid #c4cbd3; margin: 8px 0; padding: 4px 10px; background: #fafbfc; }
.msg .role { font-size: 11px; font-weight: 700; text-transform: uppercase; color: #5b6672; }
.msg.system { border-color: #8e99a4; } .msg.user { border-color: #4a9d5b; } .msg.tool { border-color: #9b59b6; }
.msg.assistant { border-color: #2f6fb3; background: #f3f8fd; }
.text { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; font-size: 13px; }
.toolcall { font-family: ui-monospace, monospace; font-size: 12px; background: #f4ecf7; padding: 2px 6px; margin: 3px 0; border-radius: 3px; white-space: pre-wrap; }
.call-head { font-size: 12px; color: #5b6672; margin-top: 14px; border-top: 1px dashed #c4cbd3; padding-top: 4px; }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 11px; background: #e6e8eb; margin-left: 4px; }
.badge.trained { background: #d4edda; } .badge.err { background: #f8d7da; }
.tokens { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.7; }
.tok { border-radius: 2px; }
.tok.ctx { color: #8a939c; background: #eceff2; }
.legend span { margin-right: 10px; font-size: 12px; }
.empty { color: #8a939c; font-style: italic; }
.kv span { margin-right: 14px; }
</style>
</head>
<body>
<header>
  <h1>Run {{ run.run_id }}</h1>
  <div class="meta">
    <span>steps {{ fmt(run.steps_done) }} / {{ fmt(run.steps_planned) }}</span>
    <span>model version {{ fmt(run.model_version) }}</span>
    <span>rollouts shown {{ run.rollouts_shown }} of {{ run.rollouts_total }}</span>
    <span>generated {{ run.generated_at }}</span>
  </div>
  <div class="meta"><span>{{ run.folder }}</span></div>
</header>

<section>
  <h2>Reward curve</h2>
  <div class="card">
  {% if curve.empty %}<p class="empty">No reward metrics logged yet.</p>{% else %}
  <svg id="reward-curve" width="{{ curve.width }}" height="{{ curve.height }}" viewBox="0 0 {{ curve.width }} {{ curve.height }}" role="img" aria-label="reward per step">
    {% for y, label in curve.yticks %}<line class="grid" x1="{{ curve.left }}" x2="{{ curve.right }}" y1="{{ y }}" y2="{{ y }}"/><text x="{{ curve.left - 6 }}" y="{{ y + 4 }}" text-anchor="end">{{ label }}</text>{% endfor %}
    {% for x, label in curve.xticks %}<text x="{{ x }}" y="{{ curve.bottom + 16 }}" text-anchor="middle">{{ label }}</text>{% endfor %}
    <line class="axis" x1="{{ curve.left }}" x2="{{ curve.right }}" y1="{{ curve.bottom }}" y2="{{ curve.bottom }}"/>
    <line class="axis" x1="{{ curve.left }}" x2="{{ curve.left }}" y1="{{ curve.top }}" y2="{{ curve.bottom }}"/>
    <text x="{{ (curve.left + curve.right) / 2 }}" y="{{ curve.height - 4 }}" text-anchor="middle">training step</text>
    {% for line in curve.lines %}<polyline class="{{ line.cls }}" points="{{ line.path }}"><title>{{ line.label }}</title></polyline>
      {% for x, y, s, v in line.points %}<circle class="dot-{{ line.cls }}" cx="{{ x }}" cy="{{ y }}" r="3.5"><title>{{ line.label }} at step {{ s }}: {{ fmt(v) }}</title></circle>{% endfor %}
    {% endfor %}
  </svg>
  <div class="legend">{% for line in curve.lines %}<span><svg width="22" height="8"><line class="{{ line.cls }}" x1="0" x2="22" y1="4" y2="4"/></svg> {{ line.label }}</span>{% endfor %}</div>
  {% endif %}
  </div>
</section>

<section>
  <h2>Per-step metrics</h2>
  <div class="card scroll">
  {% if steps.rows %}
  <table id="step-table">
    <thead><tr><th>step</th>{% for c in steps.columns %}<th>{{ c }}</th>{% endfor %}</tr></thead>
    <tbody>{% for row in steps.rows %}<tr>{% for v in row %}<td>{{ fmt(v) }}</td>{% endfor %}</tr>{% endfor %}</tbody>
  </table>
  {% else %}<p class="empty">No metrics logged yet.</p>{% endif %}
  </div>
</section>

<section>
  <h2>Rollouts</h2>
  <div id="rollouts">
    <div class="card">
      <input id="filter" type="search" placeholder="filter: task, state, split, rollout id">
      <div id="rollout-list"></div>
    </div>
    <div class="card" id="rollout-detail"><p class="empty">Select a rollout to read it.</p></div>
  </div>
</section>

<script type="application/json" id="run-data">{{ data|tojson }}</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("run-data").textContent);
const ROLLOUTS = DATA.rollouts;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}
function num(v, digits) {
  if (v === null || v === undefined) return "–";
  return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(digits || 3)) : String(v);
}

function renderList(filter) {
  const q = (filter || "").toLowerCase();
  const table = el("table", {id: "rollout-table"});
  table.append(el("thead", {}, el("tr", {}, ...["#", "step", "split", "task", "reward", "adv", "state", "calls"]
    .map(h => el("th", {class: h === "task" || h === "state" || h === "split" ? "l" : ""}, h)))));
  const body = el("tbody");
  ROLLOUTS.forEach((r, i) => {
    const hay = [r.task_id, r.state, r.split, r.rollout_id, r.group_id].join(" ").toLowerCase();
    if (q && !hay.includes(q)) return;
    const tr = el("tr", {"data-index": String(i), class: "rollout-row"},
      el("td", {}, i + 1), el("td", {}, num(r.step)), el("td", {class: "l"}, r.split || ""),
      el("td", {class: "l"}, r.task_id || r.rollout_id), el("td", {}, num(r.reward)),
      el("td", {}, num(r.advantage)), el("td", {class: "l"}, r.state || ""), el("td", {}, num(r.n_calls)));
    tr.addEventListener("click", () => select(i));
    body.append(tr);
  });
  table.append(body);
  const list = document.getElementById("rollout-list");
  list.replaceChildren(ROLLOUTS.length ? table : el("p", {class: "empty"}, "No rollouts recorded."));
}

function tokenStrip(strip, masked) {
  const box = el("div", {class: "tokens"});
  strip.ids.forEach((id, k) => {
    const lp = strip.lp[k], mask = strip.mask ? strip.mask[k] : null;
    const text = Object.prototype.hasOwnProperty.call(DATA.vocab, id) ? DATA.vocab[id] : "⟨" + id + "⟩";
    const span = el("span", {class: "tok"}, text);
    let tip = "id " + id;
    if (masked && mask === 0) {
      span.classList.add("ctx");
      tip += " · inserted by the harness (mask 0, not trained)";
    } else if (lp !== null) {
      const p = Math.exp(lp);
      span.style.background = "rgba(214, 69, 65, " + (0.08 + 0.72 * (1 - p)).toFixed(3) + ")";
      tip += " · logprob " + lp.toFixed(3) + " · p " + p.toFixed(3) + (masked ? " · trained (mask 1)" : "");
    }
    span.setAttribute("title", tip);
    box.append(span);
  });
  return box;
}

function message(m) {
  const box = el("div", {class: "msg " + m.role}, el("div", {class: "role"}, m.role + (m.tool_call_id ? " · " + m.tool_call_id : "")));
  if (m.reasoning) box.append(el("div", {class: "text empty"}, m.reasoning));
  if (m.content) box.append(el("div", {class: "text"}, m.content));
  for (const t of m.tool_calls || []) box.append(el("div", {class: "toolcall"}, "tool call " + t.name + "(" + t.arguments + ")" + (t.id ? "  [" + t.id + "]" : "")));
  return box;
}

function select(i) {
  const r = ROLLOUTS[i];
  document.querySelectorAll("#rollout-list tr.selected").forEach(tr => tr.classList.remove("selected"));
  const row = document.querySelector('#rollout-list tr[data-index="' + i + '"]');
  if (row) row.classList.add("selected");
  const d = document.getElementById("rollout-detail");
  const head = el("div", {},
    el("h2", {}, (r.task_id || "rollout") + " · " + r.rollout_id + " (attempt " + r.attempt + ")"),
    el("div", {class: "kv"}, el("span", {}, "reward " + num(r.reward) + (r.reward_source ? " (" + r.reward_source + ")" : "")),
      el("span", {}, "advantage " + num(r.advantage)), el("span", {}, "state " + (r.state || "–")),
      el("span", {}, "split " + (r.split || "–")), el("span", {}, "step " + num(r.step)),
      el("span", {}, "model version " + num(r.model_version)), el("span", {}, "calls " + num(r.n_calls)),
      el("span", {}, "duration " + num(r.duration_s) + " s")));
  if (r.error) head.append(el("div", {class: "msg tool"}, "error: " + r.error));
  const conv = el("div", {id: "conversation"});
  if (!r.calls.length) conv.append(el("p", {class: "empty"}, "No model calls recorded for this rollout."));
  for (const c of r.calls) {
    conv.append(el("div", {class: "call-head"}, "call " + num(c.seq) + " · " + (c.endpoint || "") + " · v" + num(c.model_version) +
      " · " + num(c.latency_ms, 4) + " ms · finish " + (c.finish_reason || "–"),
      c.sample !== null && c.sample !== undefined ? el("span", {class: "badge trained"}, "trained in sample " + c.sample) : el("span", {class: "badge"}, "not trained"),
      c.secret_detected ? el("span", {class: "badge err"}, "secret masked") : null,
      c.error ? el("span", {class: "badge err"}, c.error) : null,
      c.new_context ? el("span", {class: "badge"}, "new context") : null));
    for (const m of c.messages) conv.append(message(m));
    const answer = message(c.answer);
    answer.classList.add("answer");
    if (c.tokens.ids.length) answer.append(el("details", {}, el("summary", {}, c.tokens.ids.length + " generated tokens, shaded by logprob"), tokenStrip(c.tokens, false)));
    conv.append(answer);
  }
  const samples = el("div", {id: "samples"}, el("h2", {}, "Training samples"));
  if (!r.samples.length) samples.append(el("p", {class: "empty"}, "No training samples (an eval rollout, or not built yet)."));
  for (const s of r.samples) {
    samples.append(el("div", {class: "call-head"}, "sample " + s.index + " · " + s.n_calls + " call(s) · advantage " + num(s.advantage) + (s.break_reason ? " · break: " + s.break_reason : "")));
    samples.append(tokenStrip(s.tokens, true));
  }
  samples.append(el("div", {class: "legend"}, el("span", {}, "red = the policy found the token unlikely (shade = 1 - p)"), el("span", {class: "tok ctx"}, "grey = inserted by the harness, not trained")));
  d.replaceChildren(head, conv, samples);
  history.replaceState(null, "", "#rollout=" + (i + 1));
}

document.getElementById("filter").addEventListener("input", e => renderList(e.target.value));
renderList("");
const wanted = /^#rollout=(\d+)$/.exec(location.hash);
if (wanted && ROLLOUTS[Number(wanted[1]) - 1]) select(Number(wanted[1]) - 1);
</script>
</body>
</html>
"""
