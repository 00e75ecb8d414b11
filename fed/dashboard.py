"""`fed dashboard`: a live page of the run on 127.0.0.1 — the fleet table, the run's phase and ETA, and the loss,
accuracy and seconds curves — refreshing by itself.

The standard library only: `http.server` serves one HTML page (inline CSS and JavaScript, the curves drawn as SVG;
no front-end build step, nothing fetched from outside) and `/api/status`, the JSON of `fed status --json` plus every
round's history. The page polls that endpoint and redraws; every text from the run is set as text, never as markup
(a participant id, a reason, a host name come from outside).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from store.connection import Connection

Source = Callable[[], dict[str, Any]]
DEFAULT_PORT = 8765


def status_source(connection: Connection, named: str = "") -> Source:
    """What the page shows, read from the run's records at each request: `fed status --json` and the history of
    every round (loss, accuracy, seconds). `named`: how the commands it shows name the run."""
    from fed.localrun import store_for
    from fed.status import collect

    store = store_for(connection)

    def read() -> dict[str, Any]:
        body = collect(connection, named=named).to_json()
        body["history"] = [
            {"round": r.round, "loss": r.loss, "accuracy": r.accuracy, "seconds": round(r.seconds, 3),
             "aggregated": r.aggregated, "counted": len(r.counted), "selected": len(r.selected)}
            for r in sorted(store.rounds(), key=lambda r: r.round)
        ]
        return body

    return read


class Dashboard:
    """The page's server: `start()` serves on a thread (port 0: any free port), `stop()` ends it."""

    def __init__(self, source: Source, host: str = "127.0.0.1", port: int = DEFAULT_PORT, interval: float = 2.0,
                 title: str = "fed dashboard") -> None:
        page = PAGE.replace("__INTERVAL_MS__", str(int(interval * 1000))).replace("__TITLE__", _html(title))
        lock = threading.Lock()  # one read of the stores at a time, whatever the number of open pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", page.encode())
                elif path == "/api/status":
                    try:
                        with lock:
                            body = json.dumps(_finite(source()), allow_nan=False, default=str).encode()
                        self._send(200, "application/json", body)
                    except Exception as exc:  # a store that is gone: the page shows it and keeps polling
                        error = {"error": f"cannot read the run: {type(exc).__name__}: {exc}"[:500]}
                        self._send(503, "application/json", json.dumps(error).encode())
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found")

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; "
                                 "style-src 'unsafe-inline'")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                pass  # quiet: the page polls every few seconds

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> Dashboard:
        self._thread = threading.Thread(target=self.server.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they are shown as missing."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.2em; color: #222; }
 h1 { font-size: 1.3em; margin: 0 0 .3em; }
 #head span { margin-right: 1.4em; }
 #error { color: #b00; }
 table { border-collapse: collapse; margin: .8em 0; }
 th, td { border-bottom: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
 th { background: #f4f4f4; }
 .ok, .finished { color: #080; } .slow { color: #b60; }
 .stuck, .silent, .dropped { color: #b00; font-weight: bold; }
 #result { margin: .6em 0; padding: .4em .6em; background: #f3f8f3; border-left: 3px solid #080; }
 #result:empty { display: none; }
 #result code { font-size: .9em; }
 .bar { width: 80px; height: 8px; background: #eee; display: inline-block; margin-right: .4em; }
 .bar > div { height: 8px; background: #48c; }
 .charts { display: flex; gap: 1.2em; flex-wrap: wrap; }
 .chart h2 { font-size: 1em; margin: .2em 0; }
 svg { border: 1px solid #ddd; background: #fcfcfc; }
 .small { color: #666; font-size: .9em; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<div id="head">
 <span>phase <b id="phase">-</b></span><span>epoch <b id="epoch">-</b></span><span>round <b id="round">-</b></span>
 <span>aggregated <b id="aggregated">-</b></span><span>ETA <b id="eta">-</b></span>
 <span>round time <b id="round-seconds">-</b></span><span class="small" id="updated"></span>
</div>
<div id="error"></div>
<div id="result"></div>
<table id="fleet">
 <thead><tr><th>participant</th><th>state</th><th>condition</th><th>this round</th><th>progress</th>
 <th>samples/s</th><th>share</th><th>last seen</th><th>host / device</th><th>activity / why</th>
 <th>drops and refusals</th></tr></thead>
 <tbody></tbody>
</table>
<div class="charts">
 <div class="chart"><h2>training loss</h2><svg id="curve-loss" width="360" height="180"></svg></div>
 <div class="chart"><h2>test accuracy</h2><svg id="curve-accuracy" width="360" height="180"></svg></div>
 <div class="chart"><h2>seconds per round</h2><svg id="curve-seconds" width="360" height="180"></svg></div>
</div>
<script>
"use strict";
const INTERVAL = __INTERVAL_MS__;
const NS = "http://www.w3.org/2000/svg";
let refreshes = 0;

function secs(v) {
  if (v === null || v === undefined) return "-";
  v = Math.max(0, v);
  if (v < 120) return v.toFixed(0) + "s";
  if (v < 7200) return (v / 60).toFixed(1) + "min";
  return (v / 3600).toFixed(1) + "h";
}
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}
function setText(id, text) { document.getElementById(id).textContent = text; }

function fleet(participants) {
  const body = document.querySelector("#fleet tbody");
  const rows = [];
  for (const p of participants) {
    const tr = document.createElement("tr");
    tr.dataset.pid = p.pid;
    tr.dataset.condition = p.condition;
    cell(tr, p.pid);
    cell(tr, p.state);
    cell(tr, p.condition, p.condition);
    cell(tr, p.round_status + (p.selected ? "" : ""));
    const prog = cell(tr, "");
    if (p.progress !== null && p.progress !== undefined) {
      const bar = document.createElement("span"); bar.className = "bar";
      const fill = document.createElement("div"); fill.style.width = Math.min(100, p.progress) + "%";
      bar.appendChild(fill); prog.appendChild(bar);
      prog.appendChild(document.createTextNode(p.progress.toFixed(0) + "% (round " + p.progress_round + ")"));
    } else { prog.textContent = "-"; }
    const rate = p.samples_per_second !== null ? p.samples_per_second : p.reported_rate;
    cell(tr, rate === null || rate === undefined ? "-" : rate.toFixed(1));
    cell(tr, p.share === null || p.share === undefined ? "-" : (100 * p.share).toFixed(0) + "%");
    cell(tr, p.last_seen_ago === null ? "never" : secs(p.last_seen_ago) + " ago", p.silent ? "silent" : "");
    cell(tr, [p.host, p.device].filter(x => x).join(" ") || "-");
    cell(tr, p.reason || p.round_detail || p.activity || "");
    cell(tr, [...p.drops, ...p.refusals].slice(-3).join("; "), "small");
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function result(r, finished) {
  const box = document.getElementById("result");
  if (!r) { box.replaceChildren(); return; }
  const metrics = [["loss", r.loss], ["accuracy", r.accuracy]].filter(m => m[1] !== null)
    .map(m => m[0] + " " + m[1].toFixed(4)).join(", ");
  const parts = [];
  const head = document.createElement("b");
  head.textContent = (finished ? "final" : "latest") + " global model: round " + r.round +
    (metrics ? " (" + metrics + ")" : "");
  parts.push(head);
  for (const [label, id, text] of [["key", "result-key", r.key], ["sha256", "result-digest", r.digest],
                                   ["fetch it", "result-fetch", r.fetch]]) {
    const line = document.createElement("div");
    line.appendChild(document.createTextNode(label + " "));
    const code = document.createElement("code"); code.id = id; code.textContent = text;
    line.appendChild(code); parts.push(line);
  }
  box.replaceChildren(...parts);
}

function curve(id, history, key) {
  const svg = document.getElementById(id);
  const w = svg.width.baseVal.value, h = svg.height.baseVal.value, pad = 28;
  const pts = history.filter(r => r[key] !== null && r[key] !== undefined);
  const kids = [];
  const axis = document.createElementNS(NS, "path");
  axis.setAttribute("d", `M${pad},${pad / 2} L${pad},${h - pad} L${w - 8},${h - pad}`);
  axis.setAttribute("stroke", "#999"); axis.setAttribute("fill", "none");
  kids.push(axis);
  if (pts.length) {
    const xs = pts.map(r => r.round), ys = pts.map(r => r[key]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    // the axis starts near the data, not at 0, so the curve's shape shows (accuracy from 0.90 to 0.97, say)
    const lo = Math.min(...ys), hi = Math.max(...ys), margin = (hi - lo) * 0.08 || Math.abs(hi) * 0.05 || 1;
    const y0 = lo >= 0 ? Math.max(0, lo - margin) : lo - margin, y1 = hi + margin;  // (no axis below 0 for >= 0)
    const X = x => pad + (w - pad - 12) * (x - x0) / (x1 - x0);
    const Y = y => (h - pad) - (h - pad - pad / 2) * (y - y0) / (y1 - y0);
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", pts.map(r => X(r.round).toFixed(1) + "," + Y(r[key]).toFixed(1)).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", "#36c"); line.setAttribute("stroke-width", "2");
    line.dataset.points = String(pts.length);
    line.dataset.lastRound = String(xs[xs.length - 1]);
    kids.push(line);
    const last = pts[pts.length - 1], value = document.createElementNS(NS, "text");
    value.setAttribute("x", Math.min(X(last.round) + 3, w - 44)); value.setAttribute("y", Y(last[key]) - 4);
    value.setAttribute("font-size", "11"); value.setAttribute("font-weight", "bold");
    value.textContent = Number(last[key]).toPrecision(4);
    value.classList.add("last-value");
    kids.push(value);
    svg.dataset.lastValue = value.textContent;
    svg.dataset.axisFrom = String(y0);
    for (const [text, x, y] of [[y1.toPrecision(3), 2, pad / 2 + 4], [y0.toPrecision(3), 2, h - pad],
                                 ["round " + x0, pad, h - 8], ["" + x1, w - 30, h - 8]]) {
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "10"); t.textContent = text;
      kids.push(t);
    }
  }
  svg.replaceChildren(...kids);
  svg.dataset.points = String(pts.length);
}

async function refresh() {
  try {
    const resp = await fetch("/api/status", {cache: "no-store"});
    const s = await resp.json();
    if (!resp.ok) throw new Error(s.error || resp.statusText);
    setText("phase", s.phase); setText("epoch", s.epoch); setText("round", s.round);
    setText("aggregated", s.aggregated + (s.total_rounds !== null ? "/" + s.total_rounds : ""));
    setText("eta", secs(s.eta_seconds));
    setText("round-seconds", s.predicted_round_seconds !== null ? s.predicted_round_seconds.toFixed(1) +
            "s predicted" : (s.round_seconds !== null ? s.round_seconds.toFixed(1) + "s" : "-"));
    fleet(s.participants);
    result(s.result, s.phase === "Finished");
    curve("curve-loss", s.history, "loss");
    curve("curve-accuracy", s.history, "accuracy");
    curve("curve-seconds", s.history, "seconds");
    setText("error", "");
    refreshes += 1;
    document.body.dataset.refreshes = String(refreshes);
    setText("updated", "updated " + new Date().toLocaleTimeString());
  } catch (e) {
    setText("error", String(e));
  }
  setTimeout(refresh, INTERVAL);
}
refresh();
</script>
</body>
</html>
"""
