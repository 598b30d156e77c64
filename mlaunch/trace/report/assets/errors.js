// Collects page errors before anything else runs, for the self-test verdict (#selftest) that the
// tests read back from the rendered DOM.
window.__reportErrors = [];
window.addEventListener("error", function (e) {
  window.__reportErrors.push("error: " + String(e.message || e));
});
window.addEventListener("unhandledrejection", function (e) {
  window.__reportErrors.push("unhandled rejection: " + String(e.reason));
});
(function () {
  var original = console.error;
  console.error = function () {
    window.__reportErrors.push("console.error: " + Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
})();
