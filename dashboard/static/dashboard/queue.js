// In flight and waiting (/queue/) and a waiting request's live card (/requests/<id>/):
// both poll a small JSON endpoint (one page of rows; one request's place) and cancel
// through POST /queue/<id>/cancel (CSRF-checked, audited; web.cancel, the server's one cancel).
(function () {
  "use strict";

  function secs(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(1) + " s";
    var m = Math.floor(s / 60);
    if (m < 60) return m + " min " + Math.round(s - m * 60) + " s";
    return Math.floor(m / 60) + " h " + (m % 60) + " min";
  }

  // The estimate as a person should read it: a range while the running job is within
  // its usual time; "at least" once it overran (nobody knows when it ends).
  function waitText(e, job, beyond) {
    if (!e) {
      if (beyond) return { text: "more than " + secs(beyond.seconds), range: "behind the first " + beyond.after + " in line", cls: "" };
      return { text: "–", cls: "range" };
    }
    var guess = e.measured ? "" : " (a guess: no job has finished here yet)";
    if (e.at_least) {
      var why = job
        ? "the running job has run " + secs(job.elapsed) + ", past its usual " + secs(job.usual)
        : "the running job is past its usual time";
      var text = e.seconds < 0.05 ? "at least until the running job ends" : "at least " + secs(e.seconds) + " after the running job ends";
      return { text: text, range: why + ": nobody can say when it ends" + guess, cls: "atleast" };
    }
    return { text: secs(e.seconds), range: "likely " + secs(e.low) + " to " + secs(e.high) + guess, cls: "" };
  }

  function csrf() {
    var input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  function cancel(requestId) {
    return fetch("/queue/" + encodeURIComponent(requestId) + "/cancel", {
      method: "POST",
      credentials: "same-origin",
      headers: { "X-CSRFToken": csrf(), Accept: "application/json" },
    }).then(function (response) {
      return response.json().then(function (body) {
        if (!response.ok) throw new Error((body.error && body.error.message) || "HTTP " + response.status);
        return body;
      });
    });
  }

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function badge(node, ok, text) {
    if (!node) return;
    node.className = "conn " + (ok ? "conn-live" : "conn-lost");
    node.textContent = text;
  }

  window.llamaswapWait = { secs: secs, waitText: waitText, cancel: cancel };

  // -- the table -------------------------------------------------------------------------
  var rows = document.getElementById("queue-rows");
  if (rows) {
    var table = rows.closest("table");
    var canCancel = table.getAttribute("data-can-cancel") === "1";
    var q = document.getElementById("queue-q");
    var stateSelect = document.getElementById("queue-state");
    var summary = document.getElementById("queue-summary");
    var message = document.getElementById("queue-message");
    var pageLabel = document.getElementById("queue-page");
    var prev = document.getElementById("queue-prev");
    var next = document.getElementById("queue-next");
    var live = document.getElementById("queue-live");
    var params = new URLSearchParams(window.location.search);
    var page = parseInt(params.get("page") || "1", 10) || 1;
    var pages = 1;
    q.value = params.get("q") || "";
    stateSelect.value = params.get("state") || "all";
    var seq = 0;
    var timer = null;

    var show = function (text, bad) {
      message.hidden = false;
      message.textContent = text;
      message.className = "queue-message" + (bad ? " bad" : "");
    };

    var render = function (data, tookMs) {
      pages = data.pages || 1;
      pageLabel.textContent = "page " + data.page + " of " + pages;
      prev.disabled = data.page <= 1;
      next.disabled = data.page >= pages;
      var what = q.value.trim() ? "matching" : "in all";
      summary.textContent =
        data.matched + " " + what + " (" + data.running + " running, " + data.waiting + " waiting; " +
        data.depth + " waiting in all) · answered in " + tookMs.toFixed(0) + " ms";
      summary.setAttribute("data-took-ms", tookMs.toFixed(1));
      var body = document.createDocumentFragment();
      if (!data.rows.length) {
        var tr = el("tr", null, "empty");
        var td = el("td", q.value.trim() ? "no request matches" : "nothing in flight");
        td.colSpan = 10;
        tr.appendChild(td);
        body.appendChild(tr);
      }
      data.rows.forEach(function (r) {
        var tr = el("tr");
        tr.setAttribute("data-request-id", r.request_id);
        var idCell = el("td");
        var link = el("a", r.request_id, "rid");
        link.href = "/requests/" + encodeURIComponent(r.request_id) + "/";
        idCell.appendChild(link);
        tr.appendChild(idCell);
        tr.appendChild(el("td", r.state, "qstate"));
        tr.appendChild(el("td", r.model));
        var band = el("td");
        band.appendChild(el("span", r.band, "tag tag-" + r.band));
        tr.appendChild(band);
        tr.appendChild(el("td", String(r.priority), "n"));
        tr.appendChild(el("td", r.key || "–"));
        var where = r.position ? "#" + r.position : r.beyond ? "> " + r.beyond.after : "–";
        tr.appendChild(el("td", where + (r.lane !== "default" ? " · " + r.lane : ""), "n"));
        tr.appendChild(el("td", r.state === "waiting" ? "waited " + secs(r.waited) : "running " + secs(r.elapsed)));
        var est = el("td", null, "estimate");
        if (r.state === "waiting") {
          var w = waitText(r.estimate, data.lanes[r.lane], r.beyond);
          est.appendChild(el("span", w.text, w.cls));
          if (w.range) {
            est.appendChild(document.createTextNode(" "));
            est.appendChild(el("span", w.range, "range"));
          }
        }
        tr.appendChild(est);
        var act = el("td");
        if (canCancel) {
          var button = el("button", "Cancel", "cancel");
          button.type = "button";
          button.setAttribute("aria-label", "Cancel " + r.request_id);
          button.addEventListener("click", function () {
            button.disabled = true;
            button.textContent = "cancelling…";
            cancel(r.request_id).then(
              function (b) { show("Cancelled " + r.request_id + " (it was " + b.was + ")."); load(); },
              function (err) { show("Could not cancel " + r.request_id + ": " + err.message, true); button.disabled = false; button.textContent = "Cancel"; }
            );
          });
          act.appendChild(button);
        }
        tr.appendChild(act);
        body.appendChild(tr);
      });
      rows.replaceChildren(body);
    };

    var load = function () {
      var mine = ++seq;
      var query = new URLSearchParams({ q: q.value.trim(), state: stateSelect.value, page: String(page) });
      var started = performance.now();
      return fetch("/queue/data?" + query.toString(), { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          return response.json().then(function (body) {
            if (!response.ok) throw new Error((body.error && body.error.message) || "HTTP " + response.status);
            return body;
          });
        })
        .then(function (data) {
          if (mine !== seq) return; // a newer search answered (or will)
          render(data, performance.now() - started);
          badge(live, true, "live");
          document.body.dataset.queue = "ready";
        })
        .catch(function (err) {
          if (mine !== seq) return;
          badge(live, false, "lost: " + err.message);
        });
    };

    var remember = function () {
      var query = new URLSearchParams();
      if (q.value.trim()) query.set("q", q.value.trim());
      if (stateSelect.value !== "all") query.set("state", stateSelect.value);
      if (page > 1) query.set("page", String(page));
      var search = query.toString();
      history.replaceState(null, "", window.location.pathname + (search ? "?" + search : ""));
    };

    var debounce = null;
    q.addEventListener("input", function () {
      clearTimeout(debounce);
      debounce = setTimeout(function () { page = 1; remember(); load(); }, 150);
    });
    stateSelect.addEventListener("change", function () { page = 1; remember(); load(); });
    prev.addEventListener("click", function () { if (page > 1) { page--; remember(); load(); } });
    next.addEventListener("click", function () { if (page < pages) { page++; remember(); load(); } });
    load();
    timer = setInterval(function () { if (!document.hidden) load(); }, 2000);
  }

  // -- one waiting request ---------------------------------------------------------------
  var card = document.getElementById("request-live");
  if (card) {
    var requestId = card.getAttribute("data-request-id");
    var place = document.getElementById("live-place");
    var estimate = document.getElementById("live-estimate");
    var range = document.getElementById("live-range");
    var running = document.getElementById("live-running");
    var badgeNode = document.getElementById("request-live-badge");
    var button = document.getElementById("live-cancel");
    var note = document.getElementById("live-message");
    var ended = false;
    var unrecorded = 0;

    var paint = function (s) {
      if (!s.in_flight) {
        // Records are written in batches after the turn: keep asking until it is there
        // (at most a minute), then show it.
        unrecorded += 1;
        ended = s.recorded || unrecorded > 60;
        card.setAttribute("data-state", "ended");
        place.textContent = "Its turn has ended.";
        estimate.textContent = "";
        range.textContent = s.recorded ? "" : "Its record is being written…";
        if (button) button.hidden = true;
        if (s.recorded) window.location.reload();
        return;
      }
      card.setAttribute("data-state", s.state);
      if (s.state === "waiting") {
        place.textContent = s.position
          ? "Number " + s.position + " of " + s.depth + " in line for " + s.model + (s.lane !== "default" ? " (lane " + s.lane + ")" : "") + ", waiting " + secs(s.waited) + " so far."
          : "Behind the first " + (s.beyond ? s.beyond.after : "ranked") + " of " + s.depth + " in line for " + s.model + ", waiting " + secs(s.waited) + " so far.";
        var w = waitText(s.estimate, s.running_job, s.beyond);
        estimate.textContent = "Estimated wait: " + w.text;
        estimate.className = "big " + w.cls;
        range.textContent = w.range || "";
        running.textContent = s.running_job
          ? "Running now: " + s.running_job.request_id + " on " + s.running_job.model + ", for " + secs(s.running_job.elapsed) + " (usually " + secs(s.running_job.usual) + ")."
          : "Nothing runs on its lane right now.";
      } else {
        place.textContent = (s.state === "loading" ? "Its model is loading: " : "Running now on ") + s.model + " for " + secs(s.elapsed) + ".";
        estimate.textContent = "";
        range.textContent = "";
        running.textContent = "";
      }
    };

    var poll = function () {
      if (ended || document.hidden) return;
      fetch("/requests/" + encodeURIComponent(requestId) + "/status", { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          if (!response.ok) throw new Error("HTTP " + response.status);
          return response.json();
        })
        .then(function (s) { paint(s); badge(badgeNode, true, "live"); })
        .catch(function (err) { badge(badgeNode, false, "lost: " + err.message); });
    };
    if (button) {
      button.addEventListener("click", function () {
        button.disabled = true;
        cancel(requestId).then(
          function (b) { note.hidden = false; note.textContent = "Cancelled (it was " + b.was + ")."; poll(); },
          function (err) { note.hidden = false; note.textContent = "Could not cancel: " + err.message; button.disabled = false; }
        );
      });
    }
    poll();
    setInterval(poll, 1000);
  }
})();
