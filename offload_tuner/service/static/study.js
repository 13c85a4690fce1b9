// One study: the answer first (the pick for the objective, best TG, best PP, the reference, ratios, VRAM, flags to
// copy: the numbers of report --json), then TG and PP against peak VRAM (every trial, the VRAM front, the engine
// baselines, the budget line); hover shows a config, a click shows its llama-server / llama-cli / llama-bench
// lines with copy buttons; the trials table sorts by any column, trials queued that did not run are listed apart;
// a tune writing the study (this server's or any other) updates everything through server-sent events.
"use strict";
(function () {
  const GiB = 1024 ** 3;
  // the study as kept (study-data), its writer and this server's job as they are now (study-live)
  let data = Object.assign(JSON.parse(document.getElementById("study-data").textContent),
                           JSON.parse(document.getElementById("study-live").textContent));
  const name = data.study;
  const charts = {};
  window.otCharts = charts;            // the browser test finds the points here

  const colors = {trials: "rgba(120,120,120,0.45)", front: "#d62728", budget: "#444",
                  baselines: ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]};
  const styles = ["triangle", "rectRot", "star", "rect", "crossRot"];

  function pointOf(t, key) {
    return {x: t.vram_bytes / GiB, y: t[key], ref: {kind: "trial", row: t}};
  }

  function datasets(key) {
    const ok = data.trials.filter(t => t.ok && t[key] != null && t.vram_bytes != null);
    const frontIds = new Set((data.vram_fronts || {})[key.slice(0, 2)] || []);
    const front = ok.filter(t => frontIds.has(t.trial)).sort((a, b) => a.vram_bytes - b.vram_bytes);
    const sets = [
      {label: "trials", data: ok.filter(t => !frontIds.has(t.trial)).map(t => pointOf(t, key)), pointStyle: "circle",
       backgroundColor: colors.trials, borderColor: colors.trials, pointRadius: 3, order: 3},
      {label: "front", data: front.map(t => pointOf(t, key)), showLine: true, stepped: "before", pointStyle: "circle",
       backgroundColor: colors.front, borderColor: colors.front, pointRadius: 5, pointHoverRadius: 8, order: 1},
    ];
    (data.baselines || []).forEach((b, i) => {
      const m = b.measured || {};
      const vram = Object.values(m.peak_at_ctx || m.peak_bytes || {}).reduce((a, v) => a + v, 0);
      if (!b.ok || m[key] == null || !vram) return;
      sets.push({label: b.name, data: [{x: vram / GiB, y: m[key], ref: {kind: "baseline", row: b}}],
                 pointStyle: styles[i % styles.length], pointRadius: 9, pointHoverRadius: 11,
                 backgroundColor: colors.baselines[i % colors.baselines.length],
                 borderColor: colors.baselines[i % colors.baselines.length], order: 0});
    });
    if (data.budget_bytes) {
      const ys = ok.map(t => t[key]);
      const top = ys.length ? Math.max(...ys) * 1.05 : 1;
      sets.push({label: "budget", data: [{x: data.budget_bytes / GiB, y: 0}, {x: data.budget_bytes / GiB, y: top}],
                 showLine: true, borderDash: [6, 4], borderColor: colors.budget, pointRadius: 0, pointStyle: "line",
                 pointHitRadius: 0, order: 2});
    }
    return sets;
  }

  function describe(ref) {
    const r = ref.row;
    if (ref.kind === "trial") {
      return {title: `trial ${r.trial}: ${r.label}`, tg: r.tg_tps, pp: r.pp_tps, vram: r.vram_bytes,
              commands: Object.fromEntries(["llama-server", "llama-cli", "llama-bench"]
                .filter(k => r[k]).map(k => [k, r[k]]))};
    }
    const m = r.measured || {};
    const vram = Object.values(m.peak_at_ctx || m.peak_bytes || {}).reduce((a, v) => a + v, 0);
    return {title: `baseline ${r.name}` + (r.label ? `: ${r.label}` : ""), tg: m.tg_tps, pp: m.pp_tps,
            vram: vram, commands: r.commands || {}};
  }

  function fmt(v, d) { return v == null ? "-" : Number(v).toFixed(d); }

  function show(ref) {
    const d = describe(ref);
    const panel = document.getElementById("config");
    document.getElementById("config-title").textContent = d.title;
    document.getElementById("config-speeds").textContent =
      `TG ${fmt(d.tg, 2)} t/s, PP ${fmt(d.pp, 1)} t/s, peak VRAM ${fmt(d.vram / GiB, 2)} GiB`;
    ot.commandRows(document.getElementById("config-commands"), d.commands);
    panel.hidden = false;
    // a row far down the table opens the panel above it: bring the panel into view
    panel.scrollIntoView({block: "nearest", inline: "nearest"});
  }

  // ---- the answer -----------------------------------------------------------------------------------------------
  function vramOf(m) { return Object.values((m || {}).peak_at_ctx || (m || {}).peak_bytes || {}).reduce((a, v) => a + v, 0); }

  function answerRows() {
    const best = data.best || {};
    const obj = String((data.settings || {}).objective);
    const rows = [];
    // a time study's best in seconds per mean request (lower is better), not the tokens per second it stores
    const secs = best.objective && best.objective.mean_request_s != null ? ` = ${fmt(best.objective.mean_request_s, 2)} s` : "";
    if (best.objective) rows.push({role: "objective", name: `best ${obj}${secs}`, row: best.objective});
    rows.push({role: "tg", name: "best TG", row: best.tg}, {role: "pp", name: "best PP", row: best.pp});
    const ref = (data.baselines || []).find(b => b.name === data.reference);
    if (ref && ref.ok) {
      const m = ref.measured || {};
      rows.push({role: "reference", name: `reference: ${ref.name}`, row: {
        trial: null, label: ref.label || "", tg_tps: m.tg_tps, pp_tps: m.pp_tps, vram_bytes: vramOf(m),
        tg_x: 1, pp_x: 1, vram_x: 1, commands: ref.commands || {},
        budget_share: data.budget_bytes ? vramOf(m) / data.budget_bytes : null}});
    }
    const pick = best.objective ? "objective" : obj === "tg" ? "tg" : obj === "pp" ? "pp" : null;
    return {rows: rows.filter(r => r.row), pick: pick, obj: obj, ref: ref};
  }

  let answerShown = null;
  function answer() {
    const box = document.getElementById("answer");
    const {rows, pick, obj, ref} = answerRows();
    const parts = [];
    const h = document.createElement("h2");
    h.textContent = "Answer";
    parts.push(h);
    if (data.headline) {
      const p = document.createElement("p"); p.className = "headline"; p.id = "answer-headline";
      p.textContent = data.headline; parts.push(p);
    }
    const say = document.createElement("p");
    say.id = "answer-says";
    const pr = rows.find(r => r.role === pick);
    if (!rows.some(r => r.role !== "reference")) {
      say.textContent = "No measured config yet.";
    } else if (pr) {
      const r = pr.row;
      const secs = r.mean_request_s != null ?
        `${fmt(r.mean_request_s, 2)} s per mean request (${fmt(r.value, 1)} t/s of the workload), ` : "";
      say.textContent = `Pick for objective ${obj}: trial ${r.trial}, ${secs}TG ${fmt(r.tg_tps, 2)} t/s, PP ${fmt(r.pp_tps, 1)} ` +
        `t/s, ${fmt(r.vram_bytes / GiB, 2)} GiB VRAM` +
        (ref && r.tg_x != null ? ` (${fmt(r.tg_x, 2)}x TG, ${fmt(r.pp_x, 2)}x PP of ${ref.name})` : "") + ".";
    } else {
      say.textContent = `Objective ${obj}: no single pick; best TG and best PP are the two ends of the TG/PP front ` +
        "(the charts show the front between them).";
    }
    parts.push(say);
    if (rows.length) {
      const t = document.createElement("table");
      t.className = "grid"; t.id = "answer-table";
      t.innerHTML = "<thead><tr><th></th><th>trial</th><th>TG t/s</th><th>PP t/s</th><th>peak VRAM GiB</th>" +
        `<th>of budget</th><th>TG x</th><th>PP x</th><th>VRAM x</th><th>config</th></tr></thead><tbody></tbody>`;
      for (const a of rows) {
        const r = a.row;
        const tr = document.createElement("tr");
        tr.dataset.role = a.role;
        if (a.role === pick) tr.classList.add("pick");
        const cells = [
          [a.name + (a.role === pick ? " (pick)" : ""), null, "name"],
          [r.trial == null ? "-" : String(r.trial), r.trial, "trial"],
          [fmt(r.tg_tps, 2), r.tg_tps, "tg_tps"], [fmt(r.pp_tps, 1), r.pp_tps, "pp_tps"],
          [fmt(r.vram_bytes / GiB, 2), r.vram_bytes, "vram_bytes"],
          [r.budget_share == null ? "-" : (100 * r.budget_share).toFixed(1) + "%", r.budget_share, "budget_share"],
          [r.tg_x == null ? "-" : fmt(r.tg_x, 2) + "x", r.tg_x, "tg_x"],
          [r.pp_x == null ? "-" : fmt(r.pp_x, 2) + "x", r.pp_x, "pp_x"],
          [r.vram_x == null ? "-" : fmt(r.vram_x, 2) + "x", r.vram_x, "vram_x"],
          [r.label || "", null, "label"]];
        for (const [text, value, key] of cells) {
          const td = document.createElement("td");
          td.textContent = text; td.dataset.key = key;
          if (value != null) { td.dataset.value = String(value); td.className = "r"; }
          tr.append(td);
        }
        tr.addEventListener("click", () => { answerShown = a.role; answerFlags(rows); });
        t.tBodies[0].append(tr);
      }
      parts.push(t);
      const which = document.createElement("p");
      which.id = "answer-flags-title"; which.className = "muted";
      const flags = document.createElement("div");
      flags.id = "answer-flags";
      parts.push(which, flags);
    }
    box.replaceChildren(...parts);
    if (!rows.some(r => r.role === answerShown)) answerShown = pick || (rows[0] && rows[0].role);
    answerFlags(rows);
  }

  function answerFlags(rows) {
    const a = rows.find(r => r.role === answerShown);
    const box = document.getElementById("answer-flags");
    if (!a || !box) return;
    document.querySelectorAll("#answer-table tbody tr").forEach(
      tr => tr.classList.toggle("shown", tr.dataset.role === a.role));
    document.getElementById("answer-flags-title").textContent =
      `flags of ${a.name}` + (a.row.trial != null ? ` (trial ${a.row.trial})` : "") + "; click a row for another's";
    ot.commandRows(box, a.row.commands || {});
  }

  // the served stage (tuner/served.py serving_view): a row per server run, the runs left and their minutes, the
  // verdict once there is one; shown below the answer while a tune serves and after
  function serving() {
    const v = data.serving;
    let box = document.getElementById("serving");
    if (!v) { if (box) box.remove(); return; }
    if (!box) {
      box = document.createElement("section"); box.id = "serving"; box.className = "answer";
      document.getElementById("answer").after(box);
    }
    const h = document.createElement("h2");
    h.textContent = "Served on llama-server";
    const say = document.createElement("p");
    say.id = "serving-says";
    const n = v.rows.length;
    say.textContent = v.done ? `${n} server run${n === 1 ? "" : "s"}, done: ${v.headline || ""}` :
      `${n} server run${n === 1 ? "" : "s"} so far` + (v.left != null ? `; ${v.left} left` : "") +
      (v.left && v.eta_s ? `, about ${Math.ceil(v.eta_s / 60)} min` : "") + ".";
    const t = document.createElement("table");
    t.className = "grid"; t.id = "serving-table";
    t.innerHTML = "<thead><tr><th>run</th><th>contender</th><th>round</th><th>mean request s</th><th>TTFT s</th>" +
      "<th>VRAM GiB</th><th>run s</th></tr></thead><tbody></tbody>";
    for (const r of v.rows) {
      const tr = document.createElement("tr");
      const cells = r.ok ?
        [r.run, r.name, r.round, fmt(r.request_s, 2), fmt(r.ttft_s, 2), r.vram_bytes == null ? "-" :
         fmt(r.vram_bytes / GiB, 2), fmt(r.seconds, 0)] :
        [r.run, r.name, r.round, "failed: " + r.error, "", "", fmt(r.seconds, 0)];
      for (const c of cells) { const td = document.createElement("td"); td.textContent = String(c); tr.append(td); }
      t.tBodies[0].append(tr);
    }
    box.replaceChildren(h, say, t);
  }

  function makeChart(key, canvasId, title) {
    const ctx = document.getElementById(canvasId);
    return new Chart(ctx, {
      type: "scatter",
      data: {datasets: datasets(key)},
      options: {
        // the canvas fills its .chart-box (a fixed height, the figure's width): it keeps its size across live
        // updates and follows a window resize both ways
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {x: {title: {display: true, text: "peak VRAM (GiB)"}, beginAtZero: true},
                 y: {title: {display: true, text: title}, beginAtZero: true}},
        plugins: {
          legend: {position: "bottom", labels: {usePointStyle: true}},     // the markers, not colour boxes
          tooltip: {callbacks: {label: (c) => {
            const ref = c.raw.ref;
            if (!ref) return `budget ${fmt(c.raw.x, 2)} GiB`;
            const d = describe(ref);
            return `${d.title} | TG ${fmt(d.tg, 2)}, PP ${fmt(d.pp, 1)} t/s, ${fmt(d.vram / GiB, 2)} GiB`;
          }}},
        },
        onClick: (evt, elements, chart) => {
          // where a baseline sits on a trial (the same placement), the trial is the one to show
          const refs = elements.map(el => chart.data.datasets[el.datasetIndex].data[el.index].ref).filter(r => r);
          const hit = refs.find(r => r.kind === "trial") || refs[0];
          if (hit) show(hit);
        },
      },
    });
  }

  function draw() {
    for (const [key, id, title] of [["tg_tps", "chart-tg", "TG t/s"], ["pp_tps", "chart-pp", "PP t/s"]]) {
      if (charts[key]) { charts[key].data.datasets = datasets(key); charts[key].update("none"); }
      else { charts[key] = makeChart(key, id, title); }
    }
  }

  // ---- the trials tables: runs, and the trials queued that did not run ---------------------------------------
  const table = document.getElementById("trials");
  const unrunTable = document.getElementById("unrun");
  let sortKey = "trial", sortDir = 1;
  function cell(v, d) { return v == null ? "-" : (typeof v === "number" && d != null ? v.toFixed(d) : String(v)); }
  function writing() { return Boolean((data.job && data.job.state === "running") || data.writer); }
  // a waiting trial was enqueued and has not run: it runs only if a tune resumes the study; a RUNNING one with
  // no live writer was cut short (its worker is gone)
  function ran(t) { return t.state !== "waiting" && !(t.state === "running" && !writing()); }
  function rowOf(t, clickable) {
    const tr = document.createElement("tr");
    tr.dataset.trial = t.trial;
    const vals = [cell(t.trial), cell(t.state), cell(t.source), cell(t.label), cell(t.tg_tps, 2),
                  cell(t.pp_tps, 1), t.vram_bytes == null ? "-" : (t.vram_bytes / GiB).toFixed(2),
                  String(t.error || "").slice(0, 200)];
    vals.forEach((v, i) => {
      const td = document.createElement("td");
      td.textContent = v;
      if ([0, 4, 5, 6].includes(i)) td.className = "r";
      tr.append(td);
    });
    if (clickable) tr.addEventListener("click", () => show({kind: "trial", row: t}));
    return tr;
  }
  function rows() {
    const body = table.tBodies[0];
    const sorted = data.trials.filter(ran).sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      if (x == null && y == null) return 0;
      if (x == null) return 1;
      if (y == null) return -1;
      return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y))) * sortDir;
    });
    body.replaceChildren(...sorted.map(t => rowOf(t, true)));
    const unrun = data.trials.filter(t => !ran(t));
    unrunTable.tBodies[0].replaceChildren(...unrun.map(t => rowOf(t, false)));
    document.getElementById("unrun-box").hidden = unrun.length === 0;
    document.getElementById("unrun-n").textContent = unrun.length;
    document.getElementById("unrun-why").textContent = writing()
      ? "queued: the running tune takes them next"
      : "queued trials the tune ended or stopped before, and any a stopped worker cut short; a tune that resumes " +
        "the study runs them";
    const counts = {};
    data.trials.filter(ran).forEach(t => { counts[t.state] = (counts[t.state] || 0) + 1; });
    document.getElementById("ntrials").textContent = sorted.length;
    document.getElementById("counts").textContent =
      Object.keys(counts).sort().map(k => `${counts[k]} ${k}`).join(", ") || "none";
  }
  table.tHead.querySelectorAll("th").forEach(th => th.addEventListener("click", () => {
    const key = th.dataset.key;
    sortDir = key === sortKey ? -sortDir : (["tg_tps", "pp_tps"].includes(key) ? -1 : 1);
    sortKey = key;
    table.tHead.querySelectorAll("th").forEach(h => h.classList.remove("asc", "desc"));
    th.classList.add(sortDir > 0 ? "asc" : "desc");
    rows();
  }));

  // ---- live: whoever writes the study (this server's tune, a CLI tune on the same storage) -------------------
  function badge(job, writer) {
    const running = Boolean((job && job.state === "running") || writer);
    const live = document.getElementById("live");
    live.hidden = !running;
    live.title = writer || (job ? `tune ${job.id} of this server` : "");
    const stop = document.getElementById("stop");
    stop.hidden = !(job && job.state === "running");      // a stop reaches only this server's own workers
    stop.dataset.job = job ? job.id : "";
  }
  document.getElementById("stop").addEventListener("click", async (ev) => {
    const b = ev.currentTarget;
    b.disabled = true; b.textContent = "stopping";
    const r = await ot.postJSON(`/api/tunes/${encodeURIComponent(b.dataset.job)}/stop`, {});
    b.disabled = false; b.textContent = "stop";
    const msg = document.getElementById("stop-result");
    msg.textContent = r.ok ? `tune ${r.data.id}: ${r.data.state}${r.data.error ? " (" + r.data.error + ")" : ""}`
                           : r.data.error;
    if (r.ok) { data.job = r.data.state === "running" ? r.data : null; badge(data.job, data.writer); }
  });

  function refresh() {
    return fetch(`/api/studies/${encodeURIComponent(name)}`, {credentials: "same-origin"}).then(r => r.json())
      .then(d => {
        data = d;
        draw(); rows(); answer(); serving(); badge(d.job, d.writer);
        document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
        // the study's JSON is kept for up to a second (MIN_AGE_S) while progress is read at every commit: an
        // answer older than the event that asked for it is asked again once it has aged out (a tune's last event
        // is followed by no other)
        const stale = countsKey(d.counts) !== seenCounts || ((d.serving && d.serving.rows.length) || 0) < seenServed;
        if (stale && !again) again = setTimeout(() => { again = null; refresh(); }, 1200);
      });
  }
  window.otRefresh = refresh;           // the browser test calls it as a live update does

  // trials per state: a trial that ends changes them without changing the number of trials
  function countsKey(c) { return Object.keys(c || {}).sort().map(k => `${k}:${c[k]}`).join(","); }
  let seenCounts = countsKey(data.counts), seenWriter = data.writer || null, again = null;
  let seenServed = (data.serving && data.serving.rows.length) || 0;
  function live() {
    if (!window.EventSource) return;
    const es = new EventSource(`/api/studies/${encodeURIComponent(name)}/events`);
    es.addEventListener("progress", (ev) => {
      const p = JSON.parse(ev.data);
      badge(p.job, p.writer);
      const changed = countsKey(p.counts) !== seenCounts || (p.writer || null) !== seenWriter ||
        (p.served_runs || 0) !== seenServed;
      seenCounts = countsKey(p.counts); seenWriter = p.writer || null; seenServed = p.served_runs || 0;
      if (changed) refresh();
    });
  }

  answer();
  serving();
  draw();
  rows();
  badge(data.job, data.writer);
  live();
  document.body.dataset.ready = "1";
})();
