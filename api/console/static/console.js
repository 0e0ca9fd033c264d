// kmq-tracker console: the overview's chart. Everything else is plain HTML + htmx.
// Loaded as a file (the Content-Security-Policy allows no inline script); reads its data
// from data-* attributes, which the server escapes like any other value.
(function () {
  "use strict";

  function draw(el) {
    if (typeof uPlot === "undefined") return;
    var data;
    try { data = JSON.parse(el.dataset.series); } catch (e) { return; }
    el.textContent = "";
    var width = Math.max(320, el.clientWidth || 800);
    new uPlot({
      width: width,
      height: 200,
      scales: { x: { time: true } },
      axes: [{}, { label: "per minute" }],
      series: [
        {},
        { label: "redelivered", stroke: "#2456c8", width: 2, spanGaps: false },
        { label: "dead-lettered", stroke: "#b42318", width: 2 },
      ],
    }, [data.t, data.redeliveries, data.dead_letters], el);
  }

  function drawAll(root) {
    var charts = (root || document).querySelectorAll("[data-chart]");
    for (var i = 0; i < charts.length; i++) draw(charts[i]);
  }

  document.addEventListener("DOMContentLoaded", function () { drawAll(document); });
  document.addEventListener("htmx:afterSettle", function (event) { drawAll(event.target); });
})();
