// The studies page's tune form: posted as JSON to /api/tunes (the API takes JSON only), then to the study's page.
"use strict";
(function () {
  const form = document.getElementById("tune-form");
  if (!form) return;
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = {};
    for (const el of form.elements) {
      if (!el.name) continue;
      if (el.type === "checkbox") { if (el.checked) body[el.name] = true; }
      else if (el.value.trim()) body[el.name] = el.type === "number" ? Number(el.value) : el.value.trim();
    }
    // a workload file under the server's --models folders, where given, stands for the preset chosen
    if (body.workload_file) body.workload = body.workload_file;
    delete body.workload_file;
    const out = document.getElementById("tune-error");
    out.textContent = "";
    const r = await ot.postJSON("/api/tunes", body);
    if (r.ok) { location.href = "/studies/" + encodeURIComponent(r.data.study); }
    else { out.textContent = r.data.error || `HTTP ${r.status}`; }
  });
})();
