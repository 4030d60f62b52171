// nexa console: live fragments over server-sent events, focus kept across swaps, request, fleet and benchmark charts.
// Vendor libraries (htmx, uPlot) are optional: without them forms post normally and charts are skipped.
(function () {
  "use strict";

  function startLive() {
    var live = document.getElementById("live");
    if (!live || !window.EventSource) return;
    var dirty = false, pending = null;
    live.addEventListener("input", function () { dirty = true; });
    live.addEventListener("submit", function () { dirty = false; });

    function swap(html) {
      if (dirty) { pending = html; return; }   // never throw away what someone is typing
      var focused = document.activeElement && live.contains(document.activeElement) ? document.activeElement.id : null;
      live.innerHTML = html;
      if (window.htmx) window.htmx.process(live);
      if (focused) { var el = document.getElementById(focused); if (el) el.focus(); }
      live.dispatchEvent(new CustomEvent("live:swapped"));
    }

    var source = new EventSource(live.getAttribute("data-live"));
    source.addEventListener("fragment", function (e) { swap(e.data); });
    source.addEventListener("signed-out", function () { source.close(); window.location.assign("/console/login"); });
    live.addEventListener("focusout", function () {
      if (pending !== null && !dirty) { var h = pending; pending = null; swap(h); }
    });
  }

  function startCharts() {
    var rate = document.getElementById("chart-rate");
    if (!rate) return;
    if (!window.uPlot) {
      document.getElementById("chart-note").textContent = "Charts are unavailable: the uPlot library is missing from this build.";
      return;
    }
    function width(el) { return Math.max(280, el.clientWidth || 600); }
    function make(el, series) {
      return new window.uPlot({ width: width(el), height: 200, series: [{}].concat(series), axes: [{}, {}] }, [[]], el);
    }
    var charts = [
      [make(rate, [{ label: "req/s", stroke: "#2563eb" }, { label: "errors/s", stroke: "#dc2626" }]), ["rps", "errors"], rate],
      [make(document.getElementById("chart-latency"), [{ label: "p50", stroke: "#16a34a" }, { label: "p95", stroke: "#ca8a04" }, { label: "p99", stroke: "#dc2626" }]), ["p50", "p95", "p99"], document.getElementById("chart-latency")],
      [make(document.getElementById("chart-ttft"), [{ label: "p50", stroke: "#16a34a" }, { label: "p95", stroke: "#ca8a04" }]), ["ttft50", "ttft95"], document.getElementById("chart-ttft")],
    ];
    function refresh() {
      fetch("/console/requests/series", { credentials: "same-origin" }).then(function (r) {
        if (!r.ok) throw new Error(r.status);
        return r.json();
      }).then(function (s) {
        charts.forEach(function (c) { c[0].setData([s.t].concat(c[1].map(function (k) { return s[k]; }))); });
      }).catch(function () {}).finally(function () { setTimeout(refresh, 1000); });
    }
    window.addEventListener("resize", function () {
      charts.forEach(function (c) { c[0].setSize({ width: width(c[2]), height: 200 }); });
    });
    refresh();
  }

  // The GPU and runtime charts (overview, nodes): one uPlot per chart, rebuilt when its series change.
  function startFleetCharts() {
    var els = Array.prototype.slice.call(document.querySelectorAll(".fleet-chart"));
    if (!els.length) return;
    if (!window.uPlot) {
      document.getElementById("fleet-chart-note").textContent = "Charts are unavailable: the uPlot library is missing from this build.";
      return;
    }
    var colors = ["#2563eb", "#16a34a", "#ca8a04", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
    var built = {};
    function width(el) { return Math.max(280, el.clientWidth || 600); }
    function build(el, chart) {
      var series = [{}].concat(chart.labels.map(function (label, i) {
        return { label: label, stroke: colors[i % colors.length], spanGaps: false };
      }));
      el.innerHTML = "";
      return new window.uPlot({ width: width(el), height: 200, series: series, axes: [{}, { label: chart.unit }] }, [[]], el);
    }
    function refresh() {
      fetch("/console/fleet/series", { credentials: "same-origin" }).then(function (r) {
        if (!r.ok) throw new Error(r.status);
        return r.json();
      }).then(function (s) {
        els.forEach(function (el) {
          var key = el.getAttribute("data-chart"), chart = s.charts[key];
          if (!chart) return;
          var shape = chart.labels.join("\n");
          if (!built[key] || built[key].shape !== shape) {
            if (built[key]) built[key].plot.destroy();
            built[key] = { plot: build(el, chart), shape: shape };
          }
          built[key].plot.setData([s.t].concat(chart.values));
        });
      }).catch(function () {}).finally(function () { setTimeout(refresh, 1000); });
    }
    window.addEventListener("resize", function () {
      els.forEach(function (el) {
        var b = built[el.getAttribute("data-chart")];
        if (b) b.plot.setSize({ width: width(el), height: 200 });
      });
    });
    refresh();
  }

  // A benchmark run's curves: one uPlot per `.bench-chart`, from the JSON in its data-chart attribute
  // (x: the concurrency or offered rate of each step; a second axis for a series in tok/s).
  function startBenchCharts() {
    var els = Array.prototype.slice.call(document.querySelectorAll(".bench-chart"));
    if (!els.length) return;
    if (!window.uPlot) {
      document.getElementById("bench-chart-note").textContent = "Charts are unavailable: the uPlot library is missing from this build.";
      return;
    }
    var colors = ["#16a34a", "#ca8a04", "#dc2626", "#2563eb", "#7c3aed", "#db2777"];
    var plots = els.map(function (el) {
      var chart = JSON.parse(el.getAttribute("data-chart"));
      var units = [];
      chart.series.forEach(function (s) { if (units.indexOf(s.unit) < 0) units.push(s.unit); });
      var series = [{ label: chart.x_label }].concat(chart.series.map(function (s, i) {
        return { label: s.label, stroke: colors[i % colors.length], scale: s.unit, points: { show: true } };
      }));
      var axes = [{ label: chart.x_label }].concat(units.map(function (u, i) {
        return { scale: u, label: u, side: i ? 1 : 3, grid: { show: !i } };
      }));
      var scales = { x: { time: false } };
      var opts = { width: Math.max(280, el.clientWidth || 600), height: 220, scales: scales, series: series, axes: axes };
      return [new window.uPlot(opts, [chart.x].concat(chart.series.map(function (s) { return s.values; })), el), el];
    });
    window.addEventListener("resize", function () {
      plots.forEach(function (p) { p[0].setSize({ width: Math.max(280, p[1].clientWidth || 600), height: 220 }); });
    });
  }

  document.addEventListener("DOMContentLoaded", function () { startLive(); startCharts(); startFleetCharts(); startBenchCharts(); });
})();
