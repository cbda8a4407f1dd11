// The playground: a streamed POST /v1/chat/completions from the browser with
// X-LlamaSwap-Priority. reasoning_content chunks before the answer are the proxy's
// progress (queue place, load: proxy/progress.py); content chunks are the answer.
(function () {
  "use strict";
  var form = document.getElementById("play-form");
  var band = document.getElementById("p-band");
  var number = document.getElementById("p-priority");
  var phase = document.getElementById("p-phase");
  var progress = document.getElementById("p-progress");
  var answer = document.getElementById("p-answer");
  var meta = document.getElementById("p-meta");
  var send = document.getElementById("p-send");
  var stop = document.getElementById("p-stop");
  var controller = null;

  band.addEventListener("change", function () { number.hidden = band.value !== "custom"; });

  function setPhase(name, text) {
    phase.className = "phase phase-" + name;
    phase.textContent = text || name;
    document.body.dataset.phase = name;
    var seen = (document.body.dataset.phases || "").split(" ");
    if (seen[seen.length - 1] !== name) document.body.dataset.phases = seen.concat(name).join(" ").trim();
  }

  function fail(message) {
    setPhase("failed");
    progress.className = "progress bad";
    progress.textContent = message;
  }

  function handle(event, state) {
    if (event === "[DONE]") return;
    var data;
    try { data = JSON.parse(event); } catch (e) { return; }
    if (data.error) { fail(data.error.message || "error"); state.failed = true; return; }
    var delta = (data.choices && data.choices[0] && data.choices[0].delta) || {};
    if (delta.reasoning_content && !state.answering) {
      var text = delta.reasoning_content;
      state.progress += text;
      progress.textContent = state.progress.trim().split("\n").pop();
      var last = state.progress.trim().split("\n").pop();
      setPhase(/loading|Done!/.test(last) ? "loading" : "queued");
    }
    if (delta.content) {
      if (!state.answering) { state.answering = true; setPhase("streaming"); }
      answer.textContent += delta.content;
    }
    if (data.usage) state.usage = data.usage;
  }

  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var model = document.getElementById("p-model").value;
    var priority = band.value === "custom" ? String(parseInt(number.value, 10) || 0) : band.value;
    var prompt = document.getElementById("p-prompt").value;
    answer.textContent = ""; meta.textContent = ""; progress.className = "progress";
    progress.textContent = "waiting for its turn (queued, or its model loading)…";
    document.body.dataset.phases = "";
    setPhase("waiting");
    send.disabled = true; stop.disabled = false;
    controller = new AbortController();
    var started = performance.now();
    var state = { answering: false, progress: "", failed: false, usage: null };
    fetch("/v1/chat/completions", {
      method: "POST", credentials: "same-origin", signal: controller.signal,
      headers: { "Content-Type": "application/json", "X-LlamaSwap-Priority": priority },
      body: JSON.stringify({ model: model, stream: true, messages: [{ role: "user", content: prompt }] }),
    }).then(function (r) {
      var id = r.headers.get("X-LlamaSwap-Request-Id");
      if (id) meta.innerHTML = 'request <a class="rid" href="/requests/' + encodeURIComponent(id) + '/">' + id.substring(0, 8) + "</a>";
      if (!r.ok) {
        return r.json().then(function (j) { fail((j.error && j.error.message) || ("HTTP " + r.status)); },
                             function () { fail("HTTP " + r.status); });
      }
      var reader = r.body.getReader();
      var decoder = new TextDecoder();
      var buffer = "";
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) return;
          buffer += decoder.decode(chunk.value, { stream: true });
          var parts = buffer.split("\n\n");
          buffer = parts.pop();
          parts.forEach(function (part) {
            part.split("\n").forEach(function (line) {
              if (line.indexOf("data: ") === 0) handle(line.substring(6), state);
            });
          });
          return pump();
        });
      }
      return pump().then(function () {
        if (state.failed) return;
        var secs = ((performance.now() - started) / 1000).toFixed(1);
        setPhase("done");
        progress.textContent = "answered in " + secs + " s";
        if (state.usage) meta.insertAdjacentText("beforeend", " · " + state.usage.prompt_tokens + " tokens in, " + state.usage.completion_tokens + " out");
      });
    }).catch(function (err) {
      if (err && err.name === "AbortError") { setPhase("failed", "stopped"); progress.textContent = "stopped"; }
      else fail("the server did not answer: " + err);
    }).then(function () { send.disabled = false; stop.disabled = true; controller = null; });
  });

  stop.addEventListener("click", function () { if (controller) controller.abort(); });
})();
