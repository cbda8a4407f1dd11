// The logs page: polls /dashboard/logs/feed?after=N every second, keeps the last N lines
// (data-kept), filters them in the browser by source, model, level and text.
(function () {
  "use strict";
  var box = document.getElementById("log");
  var kept = parseInt(box.dataset.kept, 10) || 2000;
  var live = document.getElementById("logs-live");
  var count = document.getElementById("log-count");
  var f = {
    source: document.getElementById("f-source"), model: document.getElementById("f-model"),
    level: document.getElementById("f-level"), text: document.getElementById("f-text"),
    follow: document.getElementById("f-follow"),
  };
  var RANK = { debug: 0, info: 1, output: 1, warn: 2, error: 3 };
  var lines = [];  // {seq, t, source, model, level, text, el}
  var after = 0;

  function pad(n, w) { n = String(n); while (n.length < (w || 2)) n = "0" + n; return n; }
  function stamp(t) {
    var d = new Date(t * 1000);
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + "." + pad(d.getMilliseconds(), 3);
  }
  function shown(l) {
    if (f.source.value && l.source !== f.source.value) return false;
    if (f.model.value && l.model !== f.model.value) return false;
    if (f.level.value && (RANK[l.level] || 0) < RANK[f.level.value]) return false;
    if (f.text.value && l.text.toLowerCase().indexOf(f.text.value.toLowerCase()) < 0) return false;
    return true;
  }
  function element(l) {
    var el = document.createElement("span");
    el.className = "l src-" + l.source + " lv-" + l.level;
    el.dataset.seq = l.seq;
    var t = document.createElement("span"); t.className = "t"; t.textContent = stamp(l.t) + " ";
    t.title = new Date(l.t * 1000).toISOString();
    var lv = document.createElement("span"); lv.className = "lv"; lv.textContent = (l.source === "proxy" ? "[" + l.level + "] " : "");
    var m = document.createElement("span"); m.className = "m"; m.textContent = l.model ? "[" + l.model + "] " : "";
    var x = document.createElement("span"); x.className = "x"; x.textContent = l.text;
    el.appendChild(t); el.appendChild(lv); el.appendChild(m); el.appendChild(x);
    el.hidden = !shown(l);
    return el;
  }
  function counted() {
    var visible = 0;
    for (var i = 0; i < lines.length; i++) if (!lines[i].el.hidden) visible++;
    count.textContent = visible + " of " + lines.length + " lines shown";
  }
  function add(batch) {
    var atEnd = box.scrollTop + box.clientHeight >= box.scrollHeight - 30;
    var frag = document.createDocumentFragment();
    batch.forEach(function (l) { l.el = element(l); lines.push(l); frag.appendChild(l.el); });
    box.appendChild(frag);
    while (lines.length > kept) box.removeChild(lines.shift().el);
    if (f.follow.checked && (atEnd || batch.length)) box.scrollTop = box.scrollHeight;
    counted();
  }
  function refilter() {
    lines.forEach(function (l) { l.el.hidden = !shown(l); });
    counted();
    if (f.follow.checked) box.scrollTop = box.scrollHeight;
  }
  ["source", "model", "level"].forEach(function (k) { f[k].addEventListener("change", refilter); });
  f.text.addEventListener("input", refilter);

  function setLive(ok) {
    live.className = "conn " + (ok ? "conn-live" : "conn-lost");
    live.textContent = ok ? "live" : "not updating";
    document.body.dataset.connection = ok ? "live" : "lost";
  }
  function poll() {
    fetch("/dashboard/logs/feed?after=" + after, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
      .then(function (data) { after = data.last; if (data.lines.length) add(data.lines); setLive(true); })
      .catch(function () { setLive(false); })
      .then(function () { setTimeout(poll, 1000); });
  }
  poll();
})();
