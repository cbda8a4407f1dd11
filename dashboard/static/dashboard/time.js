// One convention for times on every page: the viewer's local time, 24-hour, with the zone
// named in the header ("times in Europe/Berlin (UTC+1)"). The server renders
// <time datetime="...Z" data-show="datetime|time"> with the UTC value as text (what a page
// without scripts shows, under "times in UTC"); this rewrites the text in local time and
// keeps the UTC value in the tooltip. dashboard.js formats live rows and chart axes with it.
(function () {
  "use strict";

  var zone = "";
  try {
    zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "";
  } catch (e) {
    zone = "";
  }

  function pad(n) { return (n < 10 ? "0" : "") + n; }

  // "UTC+1", "UTC-3:30", "UTC" for the offset in effect at ``date`` (default: now).
  function offset(date) {
    var minutes = -(date || new Date()).getTimezoneOffset();
    if (minutes === 0) return "UTC";
    var sign = minutes < 0 ? "-" : "+";
    minutes = Math.abs(minutes);
    var h = Math.floor(minutes / 60), m = minutes % 60;
    return "UTC" + sign + h + (m ? ":" + pad(m) : "");
  }

  // "times in Europe/Berlin (UTC+1)"; "times in UTC" when the browser runs in UTC.
  function caption() {
    if (zone === "UTC" || zone === "Etc/UTC") return "times in UTC";
    return "times in " + (zone || "local time") + " (" + offset() + ")";
  }

  function hms(d) { return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()); }
  function hm(d) { return pad(d.getHours()) + ":" + pad(d.getMinutes()); }
  function ymd(d) { return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()); }

  // ``show``: "datetime" (2026-11-29 13:00:00), "time" (13:00:00), "minute" (13:00) or
  // "zoned" (2026-11-29 13:00:00 UTC+1: where no header names the zone, as in the admin).
  function format(d, show) {
    if (show === "time") return hms(d);
    if (show === "zoned") return ymd(d) + " " + hms(d) + " " + offset(d);
    if (show === "minute") return hm(d);
    return ymd(d) + " " + hms(d);
  }

  function utcText(d) { return d.toISOString().replace("T", " ").substring(0, 19) + " UTC"; }

  // Unix seconds as a <time> element's HTML, like the server's ``timetag`` filter.
  function tag(seconds, show) {
    if (seconds === null || seconds === undefined) return "–";
    var d = new Date(seconds * 1000);
    return '<time datetime="' + d.toISOString() + '" data-show="' + (show || "datetime") +
      '" title="' + utcText(d) + '">' + format(d, show) + "</time>";
  }

  // Unix seconds as local text.
  function clock(seconds, show) {
    if (seconds === null || seconds === undefined) return "–";
    return format(new Date(seconds * 1000), show || "time");
  }

  function localize(root) {
    var elements = (root || document).querySelectorAll("time[datetime]");
    for (var i = 0; i < elements.length; i++) {
      var el = elements[i];
      var d = new Date(el.getAttribute("datetime"));
      if (isNaN(d.getTime())) continue;
      el.textContent = format(d, el.getAttribute("data-show"));
      el.title = utcText(d);
    }
  }

  function start() {
    var text = caption();
    var captions = document.querySelectorAll(".tz-caption");
    for (var i = 0; i < captions.length; i++) {
      captions[i].textContent = text;
      captions[i].title = "24-hour local time of this browser; hover a time for UTC";
    }
    // Forms read typed times in this zone (the history filters); none means UTC.
    var inputs = document.querySelectorAll("input[name=tz]");
    for (var j = 0; j < inputs.length; j++) if (zone) inputs[j].value = zone;
    localize(document);
    document.documentElement.dataset.timeZone = zone || "local";
  }

  window.llamaswapTime = {
    zone: zone, offset: offset, caption: caption, format: format, clock: clock, tag: tag,
    localize: localize,
  };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
