// The models page: renders /models/feed/ every second; staff's Load / Unload / Unload all
// post to /models/control/ with the CSRF token (dashboard/model_control.py).
(function () {
  "use strict";
  var table = document.getElementById("models-table");
  var rowsEl = document.getElementById("model-rows");
  var peersEl = document.getElementById("peer-rows");
  var fleetEl = document.getElementById("fleet-rows");
  var live = document.getElementById("models-live");
  var message = document.getElementById("control-message");
  var staff = table.dataset.staff === "true";
  var busy = {};  // model id -> the action in progress

  function esc(s) {
    return String(s === null || s === undefined ? "" : s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function secs(v) {
    if (v === null || v === undefined) return "–";
    if (v < 60) return v.toFixed(1) + " s";
    if (v < 3600) return Math.floor(v / 60) + " min " + Math.round(v % 60) + " s";
    return Math.floor(v / 3600) + " h " + Math.round((v % 3600) / 60) + " min";
  }
  function when(t) { return window.llamaswapTime ? window.llamaswapTime.tag(t, "time") : "–"; }

  function row(m) {
    var failed = m.state === "failed";
    var cause = m.failure ? '<div class="cause' + (failed ? "" : " muted") + '">' +
      (failed ? "" : "last failed start: ") + esc(m.failure) + "</div>" : "";
    var cells = [
      '<td><strong class="model-id">' + esc(m.id) + "</strong>" +
        (m.name ? ' <span class="muted">' + esc(m.name) + "</span>" : "") + "</td>",
      '<td class="state-cell"><span class="state state-' + esc(m.state) + '">' + esc(m.state) + "</span>" + cause + "</td>",
      "<td>" + esc(m.lane) + "</td>",
      "<td>" + esc(m.group) + "</td>",
      '<td class="n">' + m.running + " / " + m.slots + "</td>",
      '<td class="n">' + m.waiting + "</td>",
      "<td>" + when(m.ready_at) + "</td>",
      '<td class="n">' + secs(m.load_seconds) + "</td>",
      '<td class="n">' + secs(m.idle_seconds) + "</td>",
      '<td class="n">' + (m.ttl ? secs(m.ttl_left) : "no ttl") + "</td>",
    ];
    if (staff) {
      var doing = busy[m.id];
      var up = m.state === "ready" || m.state === "starting";
      cells.push('<td class="actions">' +
        '<button type="button" class="btn" data-action="load" data-model="' + esc(m.id) + '"' +
        (doing || m.state === "ready" ? " disabled" : "") + ">" + (doing === "load" ? "Loading…" : "Load") + "</button> " +
        '<button type="button" class="btn" data-action="unload" data-model="' + esc(m.id) + '"' +
        (doing || !up ? " disabled" : "") + ">" + (doing === "unload" ? "Unloading…" : "Unload") + "</button></td>");
    }
    return '<tr data-model="' + esc(m.id) + '" data-state="' + esc(m.state) + '">' + cells.join("") + "</tr>";
  }

  function render(data) {
    rowsEl.innerHTML = data.models.map(row).join("") ||
      '<tr class="empty"><td colspan="11">no models configured</td></tr>';
    peersEl.innerHTML = data.peers.map(function (p) {
      return "<tr><td>" + esc(p.id) + "</td><td>" + esc(p.peer) + "</td><td>" + esc(p.upstream_model) + "</td></tr>";
    }).join("");
    document.getElementById("loaded-count").textContent = data.loaded;
    renderFleet(data.fleet);
  }

  // Fleet mode: every node, up or down, and its models' states (null on one box).
  function renderFleet(fleet) {
    if (!fleetEl) return;
    document.getElementById("fleet-card").hidden = !fleet;
    if (!fleet) return;
    document.getElementById("fleet-status").textContent = fleet.status === "ok"
      ? fleet.up + " of " + fleet.nodes.length + " nodes up; this is " + fleet.here + "."
      : "Fleet view " + fleet.status + ": every node serves its own models.";
    fleetEl.innerHTML = fleet.nodes.map(function (n) {
      var models = Object.keys(n.models).map(function (m) {
        return esc(m) + " (" + esc(n.models[m]) + ")";
      }).join(", ") || "none loaded";
      var waiting = Object.keys(n.depth).reduce(function (sum, b) { return sum + n.depth[b]; }, 0);
      return '<tr data-node="' + esc(n.node) + '"><td>' + esc(n.node) +
        (n.here ? ' <span class="tag">here</span>' : "") + "</td><td>" +
        (n.up ? "up" : "down (last heard " + esc(n.heard_ago) + " s ago)") + "</td><td>" +
        models + '</td><td class="n">' + waiting + '</td><td class="n">' + esc(n.running) + "</td></tr>";
    }).join("");
  }

  function setLive(ok) {
    live.className = "conn " + (ok ? "conn-live" : "conn-lost");
    live.textContent = ok ? "live" : "not updating";
    document.body.dataset.connection = ok ? "live" : "lost";
  }

  var timer = null;
  function poll() {
    fetch("/models/feed/", { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
      .then(function (data) { render(data); setLive(true); })
      .catch(function () { setLive(false); })
      .then(function () { timer = setTimeout(poll, 1000); });
  }
  function refresh() { clearTimeout(timer); poll(); }

  function act(action, model) {
    var body = new URLSearchParams({ action: action, model: model || "" });
    if (model) busy[model] = action;
    if (message) message.textContent = (action === "unload_all" ? "unloading every model…" : action + "ing " + model + "…");
    refresh();
    return fetch("/models/control/", {
      method: "POST", credentials: "same-origin", body: body,
      headers: { "X-CSRFToken": table.dataset.csrf, Accept: "application/json" },
    }).then(function (r) {
      return r.json().then(function (j) {
        if (message) message.textContent = r.ok ? "done: " + action.replace("_", " ") + (model ? " " + model : "") : (j.error && j.error.message) || "failed";
        if (message) message.className = "control-message" + (r.ok ? "" : " bad");
      });
    }).catch(function () {
      if (message) message.textContent = "the server did not answer";
    }).then(function () { delete busy[model]; refresh(); });
  }

  rowsEl.addEventListener("click", function (e) {
    var b = e.target.closest("button[data-action]");
    if (b) act(b.dataset.action, b.dataset.model);
  });
  var all = document.getElementById("unload-all");
  if (all) all.addEventListener("click", function () { act("unload_all", ""); });

  render(JSON.parse(document.getElementById("models-data").textContent));
  poll();
})();
