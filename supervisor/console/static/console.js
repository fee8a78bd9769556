// sfguard console: live updates of the current page over Server-Sent Events.
// The server renders each fragment (escaped); this script only swaps it in.
"use strict";
(function () {
  const box = document.getElementById("live");
  if (!box || !box.dataset.events || !window.EventSource) return;
  const source = new EventSource(box.dataset.events);
  source.addEventListener("update", function (ev) {
    box.innerHTML = ev.data;
    box.dataset.updated = String(Date.now());
  });
  source.addEventListener("ended", function () {
    // the session ended (signed out, expired, the guard stopped): no reconnecting
    source.close();
    box.classList.add("stale");
  });
  source.onerror = function () {
    box.classList.add("stale");
  };
  source.onopen = function () {
    box.classList.remove("stale");
  };
})();
