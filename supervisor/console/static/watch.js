// sfguard watch: frames of a stage's tab in; nothing goes out (a read-only view).
"use strict";
(function () {
  const img = document.getElementById("screen");
  const address = document.getElementById("address");
  const status = document.getElementById("status");
  let frames = 0;
  let lastUrl = null;
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(proto + "//" + location.host + location.pathname.replace(/\/$/, "") + "/ws");
  ws.binaryType = "blob";
  ws.onmessage = function (ev) {
    if (typeof ev.data !== "string") {
      const url = URL.createObjectURL(ev.data);
      img.onload = function () { if (lastUrl) URL.revokeObjectURL(lastUrl); lastUrl = url; };
      img.src = url;
      frames += 1;
      img.dataset.frames = String(frames);
      return;
    }
    const msg = JSON.parse(ev.data);
    if (msg.t === "state") {
      address.textContent = msg.url || "";
    } else if (msg.t === "ended") {
      status.textContent = "(ended: the stage is " + msg.state + ")";
      document.body.dataset.ended = msg.state;
    }
  };
  ws.onopen = function () { status.textContent = "(live, read-only)"; document.body.dataset.live = "1"; };
  ws.onclose = function () { if (!document.body.dataset.ended) status.textContent = "(disconnected)"; };
})();
