// The qlayer console's one script (ours, vendored with the package; no build, no library).
// It refreshes the open page's live part in place: every `data-refresh` seconds it asks the
// same URL for that part only (header X-Qlayer-Fragment: live) and swaps it in, so the
// figures move without a reload and the search box, scroll position and focus stay. Pages
// work without it; a failed refresh is shown and tried again at the next tick.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var seconds = parseFloat(live.getAttribute("data-refresh") || "0");
  if (!(seconds > 0)) { return; }
  var status = document.createElement("p");
  status.id = "live-status";
  status.className = "note";
  live.parentNode.insertBefore(status, live);
  var busy = false;
  function tick() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Qlayer-Fragment": "live" }, cache: "no-store" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        live.innerHTML = html;
        live.setAttribute("data-refreshed", String(Date.now()));
        status.textContent = "live: refreshed " + new Date().toLocaleTimeString();
        status.classList.remove("problem");
      })
      .catch(function (error) {
        status.textContent = "live refresh failed (" + error.message + "); trying again";
        status.classList.add("problem");
      })
      .then(function () { busy = false; });
  }
  window.setInterval(tick, seconds * 1000);
})();
