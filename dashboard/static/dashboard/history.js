// The history page, live: on its first page (the newest rows), fetch the same URL (same
// filters, same bounded page) every few seconds while the tab is visible, and put the
// server-rendered rows in place; rows that were not there before are marked. Older pages
// stay as they are (their rows would shift under the reader).
(function () {
  "use strict";
  var EVERY_MS = 2000;
  var badge = document.getElementById("history-live");
  var body = document.getElementById("history-rows");
  var pager = document.getElementById("history-pager");
  if (!body || !badge) return;
  var busy = false;

  function ids(root) {
    var out = {};
    var rows = root.querySelectorAll("tr[data-request-id]");
    for (var i = 0; i < rows.length; i++) out[rows[i].getAttribute("data-request-id")] = true;
    return out;
  }

  function state(cls, text) {
    badge.className = "conn " + cls;
    badge.textContent = text;
    document.body.dataset.history = cls === "conn-live" ? "live" : "lost";
  }

  function poll() {
    if (busy || document.hidden) return;
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById("history-rows");
        if (!fresh) throw new Error("no rows in the answer");
        var before = ids(body);
        if (fresh.innerHTML !== body.innerHTML) {
          body.innerHTML = fresh.innerHTML;
          var rows = body.querySelectorAll("tr[data-request-id]");
          for (var i = 0; i < rows.length; i++) {
            if (!before[rows[i].getAttribute("data-request-id")]) rows[i].classList.add("fresh");
          }
          if (window.llamaswapTime) window.llamaswapTime.localize(body);
        }
        var freshPager = doc.getElementById("history-pager");
        if (pager && freshPager) pager.innerHTML = freshPager.innerHTML;
        state("conn-live", "live");
      })
      .catch(function () { state("conn-lost", "not updating — retrying"); })
      .then(function () { busy = false; });
  }

  poll();
  setInterval(poll, EVERY_MS);
  document.addEventListener("visibilitychange", poll);
})();
