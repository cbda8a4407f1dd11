// llamaswap dashboard: the server renders the first paint; this keeps it live over the
// websocket at /ws/dashboard/ (a snapshot on connect, then coalesced updates), says when
// the connection is lost and reconnects by itself. No framework, no page reloads.
(function () {
  "use strict";

  var BANDS = ["interactive", "normal", "batch"];
  var COLORS = { interactive: "#e8590c", normal: "#1c7ed6", batch: "#7048e8" };
  var REQUEST_URL = document.currentScript.dataset.requestUrl || "/requests/";
  var HISTORY = 600; // chart points kept (one a second: ten minutes)
  var T = window.llamaswapTime; // time.js: local time, 24-hour, the zone in the header

  // -- formatting (same as dashboard/templatetags/dash.py) -----------------------------

  function secs(v) {
    if (v === null || v === undefined) return "–";
    if (v < 60) return v.toFixed(1) + " s";
    if (v < 3600) {
      var m = Math.floor(v / 60), s = Math.floor(v % 60);
      return m + "m " + (s < 10 ? "0" : "") + s + "s";
    }
    var h = Math.floor(v / 3600), mm = Math.floor((v % 3600) / 60);
    return h + "h " + (mm < 10 ? "0" : "") + mm + "m";
  }
  function num(v) {
    if (v === null || v === undefined) return "–";
    var text = v.toFixed(2).replace(/\.?0+$/, "");
    return text === "-0" || text === "" ? "0" : text;
  }
  function shortId(id) { return id && id.length > 12 ? id.substring(0, 8) : id; }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  // Text with each "YYYY-MM-DD HH:MM:SS UTC" in it in local time (dash.py's local_stamps).
  function localStamps(text) {
    return esc(text).replace(/(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) UTC/g,
      function (m, y, mo, d, h, mi, sec) { return T.tag(Date.UTC(+y, +mo - 1, +d, +h, +mi, +sec) / 1000, "zoned"); });
  }
  function termLabel(t) { return t === "swap_affinity" ? "swap affinity" : t; }
  // What changed the pick (as the pick_reason filter in dash.py): the reordering terms;
  // "uncontested" when nothing else was waiting (no runner-up); else priority and arrival.
  function pickReason(d) {
    var terms = d.reordered_by.map(function (t) { return '<span class="term">' + esc(termLabel(t)) + "</span>"; });
    if (terms.length) return terms.join(" ");
    if (!d.runner_up_id) {
      return '<span class="uncontested" title="no other request was waiting when it was picked: no runner-up">uncontested</span>';
    }
    return "priority · arrival";
  }
  function rid(id) {
    return '<a href="' + REQUEST_URL + encodeURIComponent(id) + '/" class="rid">' + esc(shortId(id)) + "</a>";
  }
  function tag(band) { return '<span class="tag tag-' + esc(band) + '">' + esc(band) + "</span>"; }
  function $(sel, root) { return (root || document).querySelector(sel); }
  function setText(sel, text, root) { var el = $(sel, root); if (el) el.textContent = text; }

  // -- rendering ------------------------------------------------------------------------

  function renderBands(snap) {
    snap.bands.forEach(function (b) {
      var card = $('.band[data-band="' + b.band + '"]');
      if (!card) return;
      setText(".depth", b.depth, card);
      setText(".oldest", secs(b.oldest_wait), card);
      setText(".dispatched", b.dispatched, card);
      setText(".r-aging", b.reorders.aging, card);
      setText(".r-affinity", b.reorders.swap_affinity, card);
    });
  }

  function renderAdvice(snap) {
    var banner = $("#advice");
    if (!banner) return;
    banner.hidden = !snap.advice;
    if (snap.advice) {
      setText("#advice .advice-text", snap.advice.message);
      setText("#advice .advice-changes", snap.advice.changes);
    }
  }

  // Open or keyed (the key ring, live); since when and by whom stays from the first paint.
  function renderAccess(snap) {
    var pill = $("#access");
    if (!pill || !snap.access) return;
    pill.textContent = snap.access.text;
    pill.className = "access access-" + (snap.access.keyed ? "keyed" : "open");
    pill.dataset.keyed = snap.access.keyed ? "true" : "false";
  }

  function renderConfig(snap) {
    var banner = $("#config-error");
    if (!banner) return;
    var error = (snap.config || {}).error || "";
    banner.hidden = !error;
    setText("#config-error .config-error-text", error);
  }

  function renderGpu(snap) {
    setText("#gpu .model-id", snap.model.id || "none");
    var state = $("#gpu .state");
    state.textContent = snap.model.state;
    state.className = "state state-" + snap.model.state;
    var lanes = (snap.lanes || []).map(function (l) {
      var loaded = l.loaded.map(function (m) {
        return esc(m.model) + ' <span class="state state-' + esc(m.state) + '">' + esc(m.state) + "</span>";
      }).join(" ") || "nothing loaded";
      return '<div class="lane" data-lane="' + esc(l.lane) + '"><strong>lane ' + esc(l.lane) + "</strong> " +
        '<span class="lane-loaded">' + loaded + '</span> · <span class="lane-running">' + l.running +
        '</span> running · <span class="lane-waiting">' + l.waiting + "</span> waiting</div>";
    });
    var box = $("#lanes");
    if (box) box.innerHTML = lanes.join("");
    renderFleet(snap.fleet);
    var rows = snap.running.map(function (j) {
      return "<tr><td>" + rid(j.request_id) + "</td><td>" + esc(j.model) + "</td><td>" + esc(j.lane) + "</td><td>" + tag(j.band) +
        '</td><td class="n">' + j.priority + "</td><td>" + esc(j.state) + '</td><td class="n">' +
        secs(j.elapsed) + "</td></tr>";
    });
    $("#running-rows").innerHTML = rows.join("") ||
      '<tr class="empty"><td colspan="7">idle — nothing running</td></tr>';
  }

  function renderFleet(fleet) {
    // Fleet mode (fleet/): every node, up or down, its loaded models and queue per band.
    var box = $("#fleet");
    if (!box) return;
    box.hidden = !fleet;
    if (!fleet) return;
    var nodes = fleet.nodes.map(function (n) {
      var up = n.up ? "up" : "down";
      return '<div class="lane" data-node="' + esc(n.node) + '"><strong>' + esc(n.node) + "</strong>" +
        (n.here ? " (here)" : "") + ' <span class="state state-' + (n.up ? "ready" : "stopped") + '">' + up +
        "</span> " + (n.loaded.map(esc).join(" ") || "nothing loaded") + " · waiting " + n.depth.interactive +
        " / " + n.depth.normal + " / " + n.depth.batch + " · " + n.running + " running" +
        (n.delayed ? ' · <span class="warn">' + n.delayed + " records waiting for the database</span>" : "") + "</div>";
    });
    box.innerHTML = '<div class="fleet-status"><strong>fleet</strong> ' + fleet.up + " of " + fleet.nodes.length +
      " up · " + esc(fleet.status) + "</div>" + nodes.join("");
  }

  function renderSettings(snap) {
    var s = snap.settings;
    // Every setting of the table, as the server wrote it (scheduler.core.settings.shown).
    Object.keys(s.shown).forEach(function (name) {
      setText('#settings dd[data-setting="' + name + '"]', s.shown[name]);
    });
    var source = $("#settings .s-source");
    if (source) source.innerHTML = localStamps(s.source);
    var since = $("#settings .s-since");
    if (since) since.innerHTML = T.tag(s.since, "time");
  }

  function renderWaiting(snap) {
    var rows = snap.waiting.map(function (w) {
      return '<tr><td class="n">' + w.rank + "</td><td>" + rid(w.request_id) + "</td><td>" + esc(w.model) +
        "</td><td>" + esc(w.lane) + "</td><td>" + tag(w.band) + '</td><td class="n">' + w.priority + '</td><td class="n">' +
        num(w.affinity) + '</td><td class="n">' + num(w.aging) + '</td><td class="n score">' +
        num(w.score) + '</td><td class="n">' + secs(w.wait) + '</td><td class="n eta">' +
        (w.eta === null || w.eta === undefined ? "–" : secs(w.eta)) + "</td></tr>";
    });
    $("#waiting-rows").innerHTML = rows.join("") ||
      '<tr class="empty"><td colspan="11">nothing waiting</td></tr>';
    setText("#waiting .waiting-count",
      snap.depth > snap.waiting_shown ? "showing " + snap.waiting_shown + " of " + snap.depth : String(snap.depth));
  }

  function renderDecisions(snap) {
    var rows = snap.decisions.map(function (d) {
      return "<tr><td>" + T.tag(d.at, "time") + "</td><td>" + rid(d.request_id) + "</td><td>" + esc(d.model) +
        "</td><td>" + tag(d.band) + '</td><td class="n">' + d.priority + '</td><td class="n score">' +
        num(d.score) + '</td><td class="n">' + secs(d.wait) + "</td><td>" + (d.swap ? "swap" : "–") +
        "</td><td>" + pickReason(d) + "</td></tr>";
    });
    $("#decision-rows").innerHTML = rows.join("") ||
      '<tr class="empty"><td colspan="9">no decisions yet</td></tr>';
  }

  // -- charts (uPlot, served from /static) -----------------------------------------------

  var data = [[], [], [], [], [], [], []]; // t, depth x3, oldest wait x3
  var charts = [];

  function addSamples(rows) {
    rows.forEach(function (r) {
      var last = data[0].length ? data[0][data[0].length - 1] : -Infinity;
      if (r[0] <= last) return;
      for (var i = 0; i < 7; i++) data[i].push(r[i]);
    });
    if (data[0].length > HISTORY) {
      for (var i = 0; i < 7; i++) data[i].splice(0, data[0].length - HISTORY);
    }
  }

  // The time axis in local 24-hour time (as the tables), one line per label, at least
  // 90 px apart so labels never run into each other: HH:MM, or HH:MM:SS when ticks fall
  // between minutes.
  function timeAxis() {
    return {
      space: 90,
      values: function (u, splits, axisIdx, space, incr) {
        var show = incr % 60 === 0 ? "minute" : "time";
        return splits.map(function (v) { return v === null ? "" : T.clock(v, show); });
      },
    };
  }

  function makeChart(el, offset, label) {
    var series = [{}].concat(BANDS.map(function (b) {
      return { label: b, stroke: COLORS[b], width: 2, value: function (u, v) { return v === null ? "–" : v; } };
    }));
    var opts = {
      width: Math.max(200, el.clientWidth), height: 180, series: series,
      scales: {
        x: { time: true, range: function (u, min, max) { return [Math.min(min, max - 60), max]; } },
        y: { range: function (u, min, max) { return [0, Math.max(1, max * 1.1)]; } } },
      axes: [timeAxis(), { label: label, size: 50 }],
      legend: { live: false },
    };
    var view = function () { return [data[0], data[offset], data[offset + 1], data[offset + 2]]; };
    var chart = new uPlot(opts, view(), el);
    return { chart: chart, el: el, view: view };
  }

  function renderCharts() {
    charts.forEach(function (c) { c.chart.setData(c.view()); });
  }

  // -- applying a snapshot ------------------------------------------------------------

  function apply(snap) {
    renderBands(snap);
    renderGpu(snap);
    renderConfig(snap);
    renderAdvice(snap);
    renderAccess(snap);
    renderSettings(snap);
    renderWaiting(snap);
    renderDecisions(snap);
    if (snap.type === "snapshot") {
      for (var i = 0; i < 7; i++) data[i].length = 0;
    }
    addSamples(snap.samples || []);
    renderCharts();
    document.body.dataset.updated = String(snap.at);
  }

  // Render at most once per animation frame, whatever arrives meanwhile.
  var pending = null;
  function schedule(snap) {
    if (pending && snap.type !== "snapshot" && pending.type === "snapshot") {
      snap.type = "snapshot"; // keep the reset of a full snapshot
      snap.samples = pending.samples.concat(snap.samples || []);
    }
    var first = pending === null;
    pending = snap;
    if (first) {
      requestAnimationFrame(function () { var s = pending; pending = null; apply(s); });
    }
  }

  // -- the websocket --------------------------------------------------------------------

  var conn = $("#conn");
  var lost = $("#lost");
  var delay = 500;

  function status(kind, text) {
    conn.className = "conn conn-" + kind;
    conn.textContent = text;
    document.body.dataset.connection = kind;
  }

  function connect() {
    var proto = location.protocol === "https:" ? "wss://" : "ws://";
    var ws = new WebSocket(proto + location.host + "/ws/dashboard/");
    ws.onopen = function () {
      delay = 500;
      lost.hidden = true;
      status("live", "live");
    };
    ws.onmessage = function (event) { schedule(JSON.parse(event.data)); };
    ws.onclose = function () {
      status("lost", "reconnecting…");
      lost.hidden = false;
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 5000);
    };
  }

  function start() {
    var initial = JSON.parse($("#initial-snapshot").textContent);
    addSamples(initial.samples || []);
    charts = [
      makeChart($("#chart-depth"), 1, "requests"),
      makeChart($("#chart-wait"), 4, "seconds"),
    ];
    window.llamaswapCharts = charts.map(function (c) { return c.chart; }); // for the console and tests
    window.addEventListener("resize", function () {
      charts.forEach(function (c) { c.chart.setSize({ width: Math.max(200, c.el.clientWidth), height: 180 }); });
    });
    if (initial.offline) {
      status("lost", "scheduler not running");
    }
    connect();
  }

  start();
})();
