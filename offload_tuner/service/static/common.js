// What every page shares: command lines shown a flag at a time (a line wraps between flags, never inside one)
// with a copy button that copies the line as it is; forms posted as JSON (the API takes nothing else).
"use strict";
window.ot = (function () {
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

  // the shell words of LINE with their places (quotes kept as written), then grouped: a flag with its value,
  // an environment assignment, the program; each group is one unbreakable span unless it is longer than a line
  function words(line) {
    const out = [];
    let i = 0;
    while (i < line.length) {
      while (i < line.length && line[i] === " ") i++;
      if (i >= line.length) break;
      const start = i;
      let quote = null;
      while (i < line.length && (quote || line[i] !== " ")) {
        if (quote) { if (line[i] === quote) quote = null; }
        else if (line[i] === "'" || line[i] === '"') quote = line[i];
        else if (line[i] === "\\") i++;
        i++;
      }
      out.push({start: start, end: i});
    }
    return out;
  }
  const isFlag = (w) => /^-{1,2}[A-Za-z]/.test(w);

  function groups(line) {
    const ws = words(line);
    const out = [];
    ws.forEach((w, k) => {
      const text = line.slice(w.start, w.end);
      const prev = out[out.length - 1];
      if (prev && prev.flag && !prev.value && !isFlag(text)) { prev.value = w; prev.end = w.end; return; }
      out.push({start: w.start, end: w.end, flag: isFlag(text), value: null, head: w});
    });
    return out;
  }

  // <code class=cmdline>: spans of flag groups separated by the line's own spaces (textContent is the line)
  function commandCode(line) {
    const code = document.createElement("code");
    code.className = "cmdline";
    let at = 0;
    for (const g of groups(line)) {
      if (g.start > at) code.append(document.createTextNode(line.slice(at, g.start)));
      const span = document.createElement("span");
      span.className = "arg" + (g.end - g.start > 60 ? " long" : "");
      const head = document.createElement("span");
      head.className = g.flag ? "flag" : "word";
      head.textContent = line.slice(g.head.start, g.head.end);
      span.append(head);
      if (g.value) {
        span.append(document.createTextNode(line.slice(g.head.end, g.value.start)));
        const v = document.createElement("span");
        v.className = "val";
        // a list value (-ot's patterns) breaks only after a comma (<wbr> adds nothing to the text), each pattern
        // whole
        line.slice(g.value.start, g.value.end).split(/(?<=,|;)/).forEach((text, k) => {
          if (k) v.append(document.createElement("wbr"));
          const part = document.createElement("span");
          part.className = "part"; part.textContent = text;
          v.append(part);
        });
        span.append(v);
      }
      code.append(span);
      at = g.end;
    }
    if (at < line.length) code.append(document.createTextNode(line.slice(at)));
    return code;
  }

  // one row per program: its name, a copy button, the line
  function commandRows(box, commands) {
    box.replaceChildren();
    for (const [tool, line] of Object.entries(commands || {})) {
      const row = document.createElement("div");
      row.className = "cmd";
      row.dataset.tool = tool;
      const label = document.createElement("span");
      label.className = "tool"; label.textContent = tool;
      const button = document.createElement("button");
      button.type = "button"; button.textContent = "copy";
      button.setAttribute("aria-label", `copy the ${tool} line`);
      button.addEventListener("click", () => copy(line, button));
      row.append(label, button, commandCode(line));
      box.append(row);
    }
  }

  // a server-rendered <div class=commands data-commands='{"tool": "line"}'>: the same rows
  function upgrade(root) {
    (root || document).querySelectorAll("[data-commands]").forEach(box => {
      commandRows(box, JSON.parse(box.dataset.commands));
    });
  }

  async function postJSON(url, body) {
    const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
                                body: JSON.stringify(body), credentials: "same-origin"});
    let d = null;
    try { d = await r.json(); } catch (e) { d = {error: `offload-tuner: error: HTTP ${r.status}`}; }
    return {ok: r.ok, status: r.status, data: d};
  }

  document.addEventListener("DOMContentLoaded", () => upgrade(document));
  return {copy: copy, commandCode: commandCode, commandRows: commandRows, upgrade: upgrade, postJSON: postJSON};
})();
