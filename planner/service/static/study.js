// One study: TG and PP against peak VRAM (every trial, the VRAM front, the engine baselines, the budget line);
// hover shows a config, click shows its llama-server / llama-cli / llama-bench lines with copy buttons; the trials
// table sorts by any column; a running tune updates everything through server-sent events.
"use strict";
(function () {
  const GiB = 1024 ** 3;
  let data = JSON.parse(document.getElementById("study-data").textContent);
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
      {label: "trials", data: ok.filter(t => !frontIds.has(t.trial)).map(t => pointOf(t, key)),
       backgroundColor: colors.trials, borderColor: colors.trials, pointRadius: 3, order: 3},
      {label: "front", data: front.map(t => pointOf(t, key)), showLine: true, stepped: "before",
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
                 showLine: true, borderDash: [6, 4], borderColor: colors.budget, pointRadius: 0,
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

  function copy(text, button) {
    const done = () => { button.textContent = "copied"; setTimeout(() => { button.textContent = "copy"; }, 1500); };
    const fallback = () => {
      const ta = document.createElement("textarea");
      ta.value = text; document.body.appendChild(ta); ta.select();
      try { document.execCommand("copy"); } catch (e) { /* the line is selectable anyway */ }
      ta.remove(); done();
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, fallback);
    } else { fallback(); }
  }

  function show(ref) {
    const d = describe(ref);
    const panel = document.getElementById("config");
    document.getElementById("config-title").textContent = d.title;
    document.getElementById("config-speeds").textContent =
      `TG ${fmt(d.tg, 2)} t/s, PP ${fmt(d.pp, 1)} t/s, peak VRAM ${fmt(d.vram / GiB, 2)} GiB`;
    const box = document.getElementById("config-commands");
    box.replaceChildren();
    for (const [tool, line] of Object.entries(d.commands)) {
      const row = document.createElement("div");
      row.className = "cmd";
      row.dataset.tool = tool;
      const label = document.createElement("span");
      label.className = "tool"; label.textContent = tool;
      const code = document.createElement("code");
      code.textContent = line;
      const button = document.createElement("button");
      button.type = "button"; button.textContent = "copy";
      button.addEventListener("click", () => copy(line, button));
      row.append(label, button, code);
      box.append(row);
    }
    panel.hidden = false;
  }

  function makeChart(key, canvasId, title) {
    const ctx = document.getElementById(canvasId);
    return new Chart(ctx, {
      type: "scatter",
      data: {datasets: datasets(key)},
      options: {
        animation: false, responsive: true, maintainAspectRatio: true, aspectRatio: 1.6,
        scales: {x: {title: {display: true, text: "peak VRAM (GiB)"}, beginAtZero: true},
                 y: {title: {display: true, text: title}, beginAtZero: true}},
        plugins: {
          legend: {position: "bottom"},
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

  // ---- the trials table -------------------------------------------------------------------------------------
  const table = document.getElementById("trials");
  let sortKey = "trial", sortDir = 1;
  function cell(v, d) { return v == null ? "-" : (typeof v === "number" && d != null ? v.toFixed(d) : String(v)); }
  function rows() {
    const body = table.tBodies[0];
    const sorted = [...data.trials].sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      if (x == null && y == null) return 0;
      if (x == null) return 1;
      if (y == null) return -1;
      return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y))) * sortDir;
    });
    body.replaceChildren(...sorted.map(t => {
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
      tr.addEventListener("click", () => show({kind: "trial", row: t}));
      return tr;
    }));
  }
  table.tHead.querySelectorAll("th").forEach(th => th.addEventListener("click", () => {
    const key = th.dataset.key;
    sortDir = key === sortKey ? -sortDir : (["tg_tps", "pp_tps"].includes(key) ? -1 : 1);
    sortKey = key;
    table.tHead.querySelectorAll("th").forEach(h => h.classList.remove("asc", "desc"));
    th.classList.add(sortDir > 0 ? "asc" : "desc");
    rows();
  }));

  // ---- live ---------------------------------------------------------------------------------------------------
  let seen = data.n_trials;
  function live() {
    if (!window.EventSource) return;
    const es = new EventSource(`/api/studies/${encodeURIComponent(name)}/events`);
    es.addEventListener("progress", (ev) => {
      const p = JSON.parse(ev.data);
      document.getElementById("live").hidden = !(p.job && p.job.state === "running");
      if (p.n_trials === seen) return;
      seen = p.n_trials;
      fetch(`/api/studies/${encodeURIComponent(name)}`).then(r => r.json()).then(d => {
        data = d;
        document.getElementById("ntrials").textContent = d.n_trials;
        draw(); rows();
      });
    });
  }

  draw();
  rows();
  live();
  document.body.dataset.ready = "1";
})();
