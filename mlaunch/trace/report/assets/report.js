// Renders the report's figures (inline JSON) with the embedded plotly.js, makes tables sortable,
// then writes a self-test verdict into <pre id="selftest">: page errors, and for every figure
// what was actually drawn (bars, markers, lines, lane labels). Tests read it from the DOM;
// people never see it.
(function () {
  "use strict";
  var errors = window.__reportErrors || [];
  var figures = JSON.parse(document.getElementById("report-figures").textContent);
  var meta = JSON.parse(document.getElementById("report-meta").textContent);
  var config = { displaylogo: false, responsive: true, scrollZoom: true };
  var pending = [];
  Object.keys(figures).forEach(function (id) {
    var el = document.getElementById(id);
    if (!el) { errors.push("no element for figure " + id); return; }
    try {
      pending.push(Plotly.newPlot(el, figures[id].data, figures[id].layout, config));
    } catch (e) {
      errors.push("figure " + id + ": " + String(e));
    }
  });
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), sortable);
  Promise.all(pending).then(selftest, function (e) {
    errors.push("render: " + String(e));
    selftest();
  });

  function sortKey(cell) {
    var v = cell.getAttribute("data-v");
    if (v !== null && v !== "" && !isNaN(Number(v))) return Number(v);
    return v !== null ? v : cell.textContent;
  }

  function sortable(table) {
    var headers = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(headers, function (th, col) {
      th.addEventListener("click", function () {
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        var asc = th.getAttribute("aria-sort") !== "ascending";
        Array.prototype.forEach.call(headers, function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", asc ? "ascending" : "descending");
        rows.sort(function (a, b) {
          var x = sortKey(a.cells[col]), y = sortKey(b.cells[col]);
          var c = typeof x === "number" && typeof y === "number"
            ? x - y : String(x).localeCompare(String(y));
          return asc ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  }

  // What one figure drew: per trace, the DOM elements plotly created for it.
  function drawn(gd, withIds) {
    var out = [];
    var groups = gd.querySelectorAll(".barlayer .trace, .scatterlayer .trace");
    Array.prototype.forEach.call(groups, function (g) {
      var cd = g.__data__;
      var trace = cd && cd[0] && cd[0].trace;
      if (!trace) return;
      var isBar = trace.type === "bar";
      var points = g.querySelectorAll(isBar ? ".point" : "path.point");
      var info = {
        name: trace.name, type: trace.type, points: points.length,
        lines: g.querySelectorAll("path.js-line").length,
      };
      if (withIds && isBar && trace.customdata) {
        info.ids = Array.prototype.map.call(points, function (p, k) {
          var i = p.__data__ && typeof p.__data__.i === "number" ? p.__data__.i : k;
          return trace.customdata[i];
        });
      }
      out.push(info);
    });
    return out;
  }

  function selftest() {
    var withIds = window.location.hash === "#selftest";
    var verdict = { errors: errors, meta: meta, figures: {}, lanes: [], tables: {},
      // every resource the page requested (a self-contained report requests none)
      resources: performance.getEntriesByType("resource").map(function (e) { return e.name; }) };
    Object.keys(figures).forEach(function (id) {
      var gd = document.getElementById(id);
      verdict.figures[id] = gd ? drawn(gd, withIds && id === "timeline") : null;
    });
    var tl = document.getElementById("timeline");
    if (tl) {
      verdict.lanes = Array.prototype.map.call(
        tl.querySelectorAll(".yaxislayer-above .ytick text"),
        function (t) { return t.textContent; });
    }
    Array.prototype.forEach.call(document.querySelectorAll("table"), function (t) {
      verdict.tables[t.id] = t.tBodies[0].rows.length;
    });
    var pre = document.getElementById("selftest");
    pre.textContent = JSON.stringify(verdict);
    pre.setAttribute("data-done", "1");
  }
})();
