// swarm-monitor's page: polls /api/state and redraws. Every string from the swarm goes in as text (textContent),
// never as markup: peers choose their own addresses and descriptions.
"use strict";

const REFRESH_MS = 2000;
const COLUMNS = [
  ["peer", (p) => p.peer_id.slice(-8)],
  ["address", (p) => p.address],
  ["transport", (p) => p.transport || "–"],
  ["status", (p) => p.status],
  ["samples/s", (p) => p.throughput.toFixed(1)],
  ["load", (p) => (p.throughput > 0 ? (100 * p.demand / p.throughput).toFixed(0) + "%" : "–")],
  ["queue", (p) => String(p.queue)],
  ["epoch", (p) => (p.epoch === null ? "–" : String(p.epoch))],
  ["version", (p) => String(p.version)],
  ["loss", (p) => (p.loss === null ? "–" : p.loss.toFixed(3))],
  ["rounds ok/failed", (p) => p.rounds_ok + "/" + p.rounds_failed],
  ["moves", (p) => String(p.moves)],
];

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}

function drawStages(state) {
  const root = document.getElementById("stages");
  root.replaceChildren();
  for (const stage of state.stages) {
    const box = el("div", undefined, "stage");
    box.dataset.stage = stage.stage;
    const title = el("h3", "Stage " + stage.stage + " ");
    title.append(el("small", stage.peers.length + " peer(s), " + stage.throughput.toFixed(1) + " samples/s capacity"));
    box.append(title);
    const table = el("table");
    const head = el("tr");
    for (const [name] of COLUMNS) head.append(el("th", name));
    table.append(head);
    for (const peer of stage.peers) {
      const row = el("tr", undefined, "peer");
      row.dataset.peer = peer.peer_id;
      for (const [name, cell] of COLUMNS) {
        row.append(el("td", cell(peer), name === "status" ? peer.status.replace(" ", "-") : undefined));
      }
      table.append(row);
    }
    if (!stage.peers.length) box.append(el("p", "no live peer", "empty"));
    else box.append(table);
    root.append(box);
  }
}

function drawLine(id, t, y, name, color) {
  const node = document.getElementById(id);
  const points = y.filter((v) => v !== null).length;
  node.dataset.points = points;
  Plotly.react(node, [{ x: t, y: y, name: name, mode: "lines", line: { color: color }, connectgaps: false }], {
    margin: { t: 10, r: 10, b: 40, l: 50 },
    xaxis: { title: { text: "seconds since the monitor started" } },
    yaxis: { title: { text: name } },
  }, { displayModeBar: false, responsive: true });
}

function drawTraffic(traffic) {
  const roles = Object.keys(traffic).sort();
  const mb = (k) => roles.map((r) => traffic[r][k] / 1e6);
  const ratio = roles.map((r) => (traffic[r].wire > 0 ? (traffic[r].fp32 / traffic[r].wire).toFixed(1) + "x less" : ""));
  Plotly.react("traffic-chart", [
    { type: "bar", name: "sent", x: roles, y: mb("wire"), text: ratio, textposition: "outside" },
    { type: "bar", name: "as fp32", x: roles, y: mb("fp32"), marker: { color: "#c9cfdb" } },
  ], {
    barmode: "group", margin: { t: 10, r: 10, b: 60, l: 50 }, yaxis: { title: { text: "MB" } },
  }, { displayModeBar: false, responsive: true });
}

function drawEvents(events) {
  const list = document.getElementById("events");
  list.replaceChildren();
  if (!events.length) list.append(el("li", "none yet", "empty"));
  for (const e of events) {
    const item = el("li", undefined, "kind-" + e.kind);
    item.append(el("span", e.t.toFixed(0) + " s", "t"), document.createTextNode(e.text));
    list.append(item);
  }
}

async function refresh() {
  try {
    const reply = await fetch("/api/state", { cache: "no-store" });
    const state = await reply.json();
    const peers = state.stages.reduce((n, s) => n + s.peers.length, 0);
    document.getElementById("summary").textContent =
      state.n_stages + " stage(s), " + peers + " peer(s); updated " + new Date().toLocaleTimeString();
    drawStages(state);
    drawLine("loss-chart", state.history.t, state.history.loss, "loss", "#c0392b");
    drawLine("speed-chart", state.history.t, state.history.samples_per_s, "samples/s", "#2c6fbb");
    drawTraffic(state.traffic);
    drawEvents(state.events);
  } catch (err) {
    document.getElementById("summary").textContent = "monitor unreachable: " + err;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
