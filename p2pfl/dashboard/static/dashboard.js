// p2pfl dashboard: polls /api/state about once a second and draws it with plain DOM and
// SVG (no library, no build step, works offline). The server's snapshot is described in
// p2pfl/dashboard/snapshot.py.
"use strict";

(() => {
  const SVGNS = "http://www.w3.org/2000/svg";
  // ?poll=MS polls faster or slower (at least every 100 ms)
  const POLL_MS = Math.max(100, Number(new URLSearchParams(location.search).get("poll")) || 1000);
  const GRAPH_SIZE = 600;
  const PULL_LIT_S = 3.0; // a pull event younger than this is animated when first seen
  const KNOWN_PARTS = new Set(["all", "g", "h"]);

  let graphKey = null; // node ids + edges the graph was built for
  let geometry = {}; // node id -> {x, y} in graph units
  let radius = 24;
  let chartVersion = null; // run version the charts were drawn for
  let lastPullSeq = 0;
  let palette = {}; // node id -> colour of its series
  let decRoundPicked = null; // a round the user chose in the decisions panel
  let highlighted = null;
  let latest = null;

  const $ = (id) => document.getElementById(id);

  function svg(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (parent) parent.appendChild(e);
    return e;
  }

  function html(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  const fmtAcc = (v) => (v === null || v === undefined ? "–" : v.toFixed(4));
  const fmtNum = (v, d) => (v === null || v === undefined ? "–" : v.toFixed(d));
  const partClass = (p) => "part-" + (KNOWN_PARTS.has(p) ? p : "other");

  // ------------------------------------------------------------------ graph
  // arrowheads, one per part colour, sized for live pulls and for the latest round's pulls
  function buildMarkers() {
    const defs = $("graph-defs");
    for (const cls of ["part-all", "part-g", "part-h", "part-other"]) {
      for (const [kind, size] of [["pull", 3.5], ["last", 7]]) {
        const m = svg("marker", {
          id: `arrow-${kind}-${cls}`, viewBox: "0 0 10 10", refX: 9, refY: 5,
          markerWidth: size, markerHeight: size, orient: "auto",
        }, defs);
        svg("path", { d: "M0,0 L10,5 L0,10 z", class: `arrowhead ${cls}` }, m);
      }
    }
  }

  function buildGraph(state) {
    const nodes = state.nodes;
    const edgeG = $("g-edges"), nodeG = $("g-nodes");
    edgeG.replaceChildren();
    nodeG.replaceChildren();
    $("g-pulls").replaceChildren();
    $("g-last").replaceChildren();
    radius = Math.max(9, Math.min(26, 150 / Math.sqrt(Math.max(1, nodes.length))));
    geometry = {};
    palette = {};
    nodes.forEach((n, i) => {
      geometry[n.id] = { x: n.x * GRAPH_SIZE, y: n.y * GRAPH_SIZE };
      palette[n.id] = `hsl(${Math.round((i * 137.508) % 360)}, 62%, 45%)`;
    });
    for (const [a, b] of state.edges) {
      const p = geometry[a], q = geometry[b];
      if (!p || !q) continue;
      svg("line", { class: "edge", "data-edge": `${a}|${b}`, x1: p.x, y1: p.y, x2: q.x, y2: q.y }, edgeG);
    }
    for (const n of nodes) {
      const p = geometry[n.id];
      const g = svg("g", { class: "node st-unknown", "data-node": n.id, transform: `translate(${p.x},${p.y})` }, nodeG);
      svg("circle", { class: "agg-ring", r: radius + 6 }, g);
      svg("circle", { class: "atk-ring", r: radius + 4 }, g);
      svg("circle", { r: radius }, g);
      const label = svg("text", { y: 0 }, g);
      label.textContent = n.id;
      if (radius < 14) label.setAttribute("class", "small");
      const sub = svg("text", { class: "sub", y: radius + 12 }, g);
      sub.textContent = "";
      // a rolled-back node's badge (its training went non-finite)
      const d = radius * 0.72;
      const badge = svg("g", { class: "div-badge", transform: `translate(${d},${-d})` }, g);
      svg("circle", { r: 7 }, badge);
      svg("text", {}, badge).textContent = "↺";
      svg("title", {}, g);
      g.addEventListener("mouseenter", () => highlight(n.id));
      g.addEventListener("mouseleave", () => highlight(null));
    }
  }

  // a node's robustness facts (its latest record), as lines of its tooltip
  function robustLines(n) {
    const out = [];
    if (n.attack && n.attack.length) out.push(`attacking: ${n.attack.join(", ")}`);
    if (n.diverged) {
      const to = n.diverged.rolled_back_to;
      const from = n.diverged.merged_from || [];
      out.push(`diverged: rolled back to ${to === null || to === undefined ? "its start" : `round ${to}`}` +
        (from.length ? ` (had merged ${from.join(", ")})` : ""));
    }
    for (const [p, why] of Object.entries(n.rejected || {})) out.push(`refused ${p}: ${why}`);
    for (const [p, r] of Object.entries(n.distrusted || {})) out.push(`distrusts ${p} until round ${r}`);
    for (const [p, c] of Object.entries(n.capped || {})) out.push(`capped ${p} (claimed ${c} samples)`);
    if (n.rollbacks) out.push(`rollbacks so far: ${n.rollbacks}`);
    return out;
  }

  const robustRun = (state) =>
    (state.refusals || 0) > 0 || (state.edge_flags || []).length > 0 ||
    state.nodes.some((n) => (n.attack && n.attack.length) || n.diverged || n.rollbacks ||
      Object.keys(n.distrusted || {}).length);

  // edges a node distrusts (dashed red) or refused on in its latest record (dotted)
  function updateEdges(state) {
    const flags = new Map((state.edge_flags || []).map((f) => [f.edge.join("|"), f]));
    for (const line of document.querySelectorAll("#g-edges line.edge")) {
      const f = flags.get(line.dataset.edge);
      line.classList.toggle("distrusted", !!f && f.distrusted);
      line.classList.toggle("refused", !!f && !f.distrusted);
      let title = line.querySelector("title");
      if (!f) {
        if (title) title.remove();
        continue;
      }
      if (!title) title = svg("title", {}, line);
      title.textContent = f.refused.map((x) => {
        const why = x.reason ? ` (${x.now ? "" : `round ${x.round}: `}${x.reason})` : "";
        return x.until !== null && x.until !== undefined
          ? `${x.by} distrusts ${x.peer} until round ${x.until}${why}`
          : `${x.by} refused ${x.peer}${why}`;
      }).join("\n");
    }
  }

  function updateNodes(state) {
    const aggNow = state.current_aggregator;
    const aggs = state.aggregators || [];
    const aggLast = aggs.length ? aggs[aggs.length - 1].node : null;
    const agg = state.kind === "centralized" ? aggNow || aggLast : null;
    $("legend-agg").hidden = state.kind !== "centralized";
    for (const n of state.nodes) {
      const g = document.querySelector(`#g-nodes [data-node="${CSS.escape(n.id)}"]`);
      if (!g) continue;
      const attacking = !!(n.attack && n.attack.length);
      g.setAttribute("class", `node st-${n.state}` + (n.id === agg ? " agg" : "") + (n.id === highlighted ? " hl" : "") +
        (attacking ? " attacking" : "") + (n.diverged ? " diverged" : ""));
      g.setAttribute("data-state", n.state);
      g.querySelector("text.sub").textContent = n.round ? `r${n.round} · ${fmtAcc(n.acc)}` : "";
      g.querySelector("title").textContent =
        `${n.id}: ${n.state}` + (n.phase_round ? ` (round ${n.phase_round})` : "") +
        `\nrecorded round ${n.round}/${state.rounds}, accuracy ${fmtAcc(n.acc)}` +
        robustLines(n).map((l) => "\n" + l).join("");
    }
  }

  // a line from a to b that stops at the nodes' rims, shifted to its right so that the
  // pulls a -> b and b -> a run side by side
  function chord(a, b, pad) {
    const p = geometry[a], q = geometry[b];
    if (!p || !q) return null;
    const dx = q.x - p.x, dy = q.y - p.y, len = Math.hypot(dx, dy) || 1;
    const ux = dx / len, uy = dy / len;
    const off = Math.min(5, radius / 4), ox = -uy * off, oy = ux * off;
    return {
      x1: p.x + ux * pad + ox, y1: p.y + uy * pad + oy,
      x2: q.x - ux * pad + ox, y2: q.y - uy * pad + oy,
    };
  }

  function drawLastPulls(state) {
    const g = $("g-last");
    g.replaceChildren();
    for (const p of state.last_pulls || []) {
      const c = chord(p.from, p.to, radius + 3);
      if (!c) continue;
      const cls = partClass(p.part);
      const line = svg("line", { ...c, class: `lastpull ${cls}`, "marker-end": `url(#arrow-last-${cls})` }, g);
      svg("title", {}, line).textContent = `round ${p.round}: ${p.to} pulled ${p.part} from ${p.from}`;
    }
  }

  function animatePulls(state) {
    const g = $("g-pulls");
    for (const p of state.pulls || []) {
      if (p.seq <= lastPullSeq) continue;
      lastPullSeq = Math.max(lastPullSeq, p.seq);
      if (p.age_s > PULL_LIT_S) continue;
      const c = chord(p.from, p.to, radius + 3);
      if (!c) continue;
      const cls = partClass(p.part);
      const line = svg("line", { ...c, class: `pull ${cls}`, "marker-end": `url(#arrow-pull-${cls})`, "data-seq": p.seq }, g);
      svg("title", {}, line).textContent =
        `round ${p.round}: ${p.to} pulled ${p.part} from ${p.from} (${(p.bytes / 1e6).toFixed(2)} MB)`;
      setTimeout(() => line.remove(), 2700);
    }
  }

  // ------------------------------------------------------------------ charts
  // about `count` round tick values in [lo, hi], and the decimals their step needs
  function niceTicks(lo, hi, count) {
    const span = hi - lo || 1;
    const step0 = span / count;
    const mag = Math.pow(10, Math.floor(Math.log10(step0)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= step0) || step0;
    const values = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) values.push(+v.toFixed(10));
    const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9) + (step / mag === 2.5 ? 1 : 0));
    return { values, decimals };
  }

  function lineChart(el, data, opts) {
    const W = 520, H = 170, m = { l: 46, r: 12, t: 8, b: 24 };
    el.setAttribute("viewBox", `0 0 ${W} ${H}`);
    el.replaceChildren();
    const all = [];
    for (const pts of Object.values(data.nodes)) all.push(...pts);
    all.push(...data.mean);
    if (!all.length) {
      const t = svg("text", { class: "empty", x: W / 2, y: H / 2 }, el);
      t.textContent = "no round recorded yet";
      return;
    }
    const xMax = Math.max(opts.rounds || 1, ...all.map((p) => p[0]));
    const xMin = Math.min(1, ...all.map((p) => p[0]));
    let yLo = Math.min(...all.map((p) => p[1]));
    let yHi = Math.max(...all.map((p) => p[1]));
    if (opts.zeroBased) yLo = 0;
    if (opts.unit) {
      yLo = Math.max(0, Math.floor(yLo * 10) / 10);
      yHi = Math.min(1, Math.ceil(yHi * 10) / 10);
    }
    if (yHi - yLo < 1e-9) yHi = yLo + (opts.unit ? 0.1 : Math.abs(yLo) * 0.1 || 1);
    else if (!opts.unit) yHi += (yHi - yLo) * 0.08;
    const X = (x) => m.l + ((x - xMin) / (xMax - xMin || 1)) * (W - m.l - m.r);
    const Y = (y) => H - m.b - ((y - yLo) / (yHi - yLo)) * (H - m.t - m.b);
    const grid = svg("g", { class: "grid" }, el);
    const axis = svg("g", { class: "axis" }, el);
    const ticks = niceTicks(yLo, yHi, 4);
    for (const v of ticks.values) {
      svg("line", { x1: m.l, x2: W - m.r, y1: Y(v), y2: Y(v) }, grid);
      const t = svg("text", { class: "tick", x: m.l - 6, y: Y(v) + 3, "text-anchor": "end" }, el);
      t.textContent = v.toFixed(ticks.decimals);
    }
    const xStep = Math.max(1, Math.ceil((xMax - xMin) / 10));
    for (let x = xMin; x <= xMax; x += xStep) {
      const t = svg("text", { class: "tick", x: X(x), y: H - m.b + 14, "text-anchor": "middle" }, el);
      t.textContent = String(x);
    }
    svg("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b }, axis);
    svg("line", { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b }, axis);
    const draw = (name, pts, colour, mean) => {
      if (!pts.length) return;
      const g = svg("g", { class: "series" + (mean ? " mean" : "") + (name === highlighted ? " hl" : ""), "data-series": name }, el);
      const line = svg("polyline", { points: pts.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") }, g);
      if (colour) line.setAttribute("stroke", colour);
      for (const p of pts) {
        const c = svg("circle", { class: "pt", cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: mean ? 3.5 : 2.2 }, g);
        if (colour) c.setAttribute("fill", colour);
        svg("title", {}, c).textContent = `${name}, round ${p[0]}: ${opts.fmt ? opts.fmt(p[1]) : p[1]}`;
      }
    };
    for (const [name, pts] of Object.entries(data.nodes)) draw(name, pts, palette[name], false);
    draw("mean", data.mean, null, true);
  }

  function drawCharts(state) {
    const s = state.series;
    lineChart($("chart-acc"), s.acc, { rounds: state.rounds, unit: true, fmt: (v) => v.toFixed(4) });
    lineChart($("chart-bytes"), s.mb_sent, { rounds: state.rounds, zeroBased: true, fmt: (v) => v.toFixed(3) });
    lineChart($("chart-time"), s.round_s, { rounds: state.rounds, zeroBased: true, fmt: (v) => v.toFixed(2) });
  }

  function highlight(id) {
    highlighted = id;
    document.body.classList.toggle("has-hl", id !== null);
    for (const e of document.querySelectorAll("[data-series]")) e.classList.toggle("hl", e.dataset.series === id);
    for (const e of document.querySelectorAll("#g-nodes [data-node]")) e.classList.toggle("hl", e.dataset.node === id);
    for (const e of document.querySelectorAll("#node-table tr[data-row]")) e.classList.toggle("hl", e.dataset.row === id);
  }

  // ------------------------------------------------------------------ panels
  function drawAggregators(state) {
    const panel = $("agg-panel");
    panel.hidden = state.kind !== "centralized";
    if (panel.hidden) return;
    const box = $("aggregators");
    box.replaceChildren();
    for (const a of state.aggregators) {
      const chip = html("span", { class: "chip", "data-round": a.round }, box, `round ${a.round}`);
      html("b", {}, chip, a.node + (a.attempt ? ` (attempt ${a.attempt})` : ""));
    }
    if (state.current_aggregator) {
      const chip = html("span", { class: "chip now" }, box, "aggregating now");
      html("b", {}, chip, state.current_aggregator);
    }
  }

  function drawDecisions(state) {
    const rows = state.decisions || [];
    const panel = $("dec-panel");
    panel.hidden = rows.length === 0;
    if (panel.hidden) return;
    const rounds = [...new Set(rows.map((r) => r.round))].sort((a, b) => b - a);
    const select = $("dec-round");
    const want = decRoundPicked !== null && rounds.includes(decRoundPicked) ? decRoundPicked : rounds[0];
    if (select.options.length !== rounds.length || +select.options[0].value !== rounds[0]) {
      select.replaceChildren(...rounds.map((r) => html("option", { value: r }, null, String(r))));
    }
    select.value = String(want);
    const body = $("decisions").tBodies[0];
    body.replaceChildren();
    for (const r of rows.filter((x) => x.round === want)) {
      const tr = html("tr", { "data-row": r.node }, body);
      html("td", {}, tr, r.node);
      const td = html("td", {}, tr);
      if (r.dropout) html("span", { class: "tag dropout" }, td, `dropout: adopts ${r.dropout_peer || "?"}'s model`);
      else html("span", { class: "tag personal" }, td, "layer-wise personalization");
      const g = Object.keys(r.pulled).filter((p) => r.pulled[p] === "g" || r.pulled[p] === "all");
      html("td", {}, tr, r.dropout ? "–" : g.join(", ") || "–");
      html("td", {}, tr, r.dropout ? "–" : r.h_peers.join(", ") || "none (keeps its own)");
    }
  }

  function drawNodeTable(state) {
    const body = $("node-table").tBodies[0];
    body.replaceChildren();
    const robust = robustRun(state);
    $("node-table").classList.toggle("no-robust", !robust);
    const lastOf = (pts) => (pts && pts.length ? pts[pts.length - 1][1] : null);
    for (const n of state.nodes) {
      const tr = html("tr", { "data-row": n.id, class: n.id === highlighted ? "hl" : "" }, body);
      html("td", {}, tr, n.id);
      const st = html("td", {}, tr);
      html("i", { class: `sw st-${n.state}` }, st);
      st.appendChild(document.createTextNode(n.state));
      html("td", {}, tr, `${n.round}/${state.rounds}`);
      const acc = html("td", {}, tr, fmtAcc(n.acc));
      if (n.epsilon !== undefined) {  // privacy.dp: ε spent so far
        const spent = n.dp_exhausted ? ", budget spent: no more local training" : "";
        html("span", { class: "tag eps", title: `ε for the run's δ${spent}` }, acc, ` ε ${n.epsilon.toFixed(2)}${n.dp_exhausted ? " (spent)" : ""}`);
      }
      html("td", {}, tr, fmtNum(lastOf(state.series.mb_sent.nodes[n.id]), 2));
      html("td", {}, tr, fmtNum(lastOf(state.series.round_s.nodes[n.id]), 1));
      const rob = html("td", { class: "robust", title: robustLines(n).join("\n") }, tr);
      if (robust) {
        if (n.attack && n.attack.length) html("span", { class: "tag attack" }, rob, `attack: ${n.attack.join(", ")}`);
        if (n.diverged) html("span", { class: "tag diverged" }, rob, "rolled back");
        const dis = Object.keys(n.distrusted || {});
        if (dis.length) html("span", { class: "tag distrust" }, rob, `distrusts ${dis.join(", ")}`);
        const rej = Object.keys(n.rejected || {});
        if (rej.length) html("span", { class: "tag refused" }, rob, `refused ${rej.join(", ")}`);
      }
      tr.addEventListener("mouseenter", () => highlight(n.id));
      tr.addEventListener("mouseleave", () => highlight(null));
    }
  }

  function drawHeader(state) {
    const status = $("run-status");
    if (!state.swarm) {
      $("title").textContent = "waiting for the run";
      status.textContent = state.status;
      status.className = "pill";
      $("footer").textContent = `run directory ${state.run_dir}`;
      return;
    }
    $("title").textContent = `${state.swarm} · ${state.algorithm}` + (state.kind ? ` (${state.kind})` : "");
    status.textContent = state.status;
    status.className = `pill ${state.status}`;
    const reached = Math.max(0, ...state.nodes.map((n) => n.round));
    const done = state.nodes.filter((n) => n.state === "done").length;
    $("progress").textContent = `round ${reached}/${state.rounds} · ${state.nodes.length} nodes, ${done} done` +
      (state.refusals ? ` · ${state.refusals} refused` : "");
    $("legend-robust").hidden = !robustRun(state);
    const b = state.broker;
    $("broker").textContent = b.address ? `broker ${b.address}: ${b.connected ? "observing" : "unreachable"}` : b.note;
    $("broker").title = b.note || "";
    const dropped = Object.entries(b.dropped || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    let foot = `run directory ${state.run_dir}`;
    if (state.summary && state.summary.acc_mean !== null) {
      foot += ` · final accuracy ${fmtAcc(state.summary.acc_mean)} ± ${fmtAcc(state.summary.acc_std)}`;
    }
    if (dropped) foot += ` · broker messages dropped: ${dropped}`;
    $("footer").textContent = foot;
  }

  function render(state) {
    latest = state;
    drawHeader(state);
    if (!state.swarm) return;
    const key = JSON.stringify([state.nodes.map((n) => [n.id, n.x, n.y]), state.edges]);
    if (key !== graphKey) {
      buildGraph(state);
      graphKey = key;
      chartVersion = null;
    }
    updateNodes(state);
    updateEdges(state);
    animatePulls(state);
    if (state.version !== chartVersion) {
      drawLastPulls(state);
      drawCharts(state);
      drawAggregators(state);
      drawDecisions(state);
      chartVersion = state.version;
    }
    drawNodeTable(state);
  }

  async function tick() {
    try {
      const r = await fetch("/api/state", { cache: "no-store" });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      render(await r.json());
      $("conn").textContent = "live";
      $("conn").className = "pill conn-ok";
    } catch (err) {
      $("conn").textContent = "server unreachable";
      $("conn").className = "pill conn-lost";
    } finally {
      setTimeout(tick, POLL_MS);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    buildMarkers();
    $("dec-round").addEventListener("change", (e) => {
      const picked = +e.target.value;
      const newest = Math.max(...[...e.target.options].map((o) => +o.value));
      decRoundPicked = picked === newest ? null : picked; // the newest: follow new rounds
      if (latest) drawDecisions(latest);
    });
    tick();
  });
})();
