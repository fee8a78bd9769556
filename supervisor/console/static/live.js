// sfguard live view: frames of the guard's login tab in, the person's input out.
// Everything goes over one same-origin WebSocket; the server forwards input to that tab only.
"use strict";
(function () {
  const img = document.getElementById("screen");
  const keys = document.getElementById("keys");
  const address = document.getElementById("address");
  const status = document.getElementById("status");
  const refused = document.getElementById("refused");
  const paste = document.getElementById("paste");
  const pasteText = document.getElementById("paste-text");
  const go = document.getElementById("go");
  const goUrl = document.getElementById("go-url");
  let size = { w: img.width, h: img.height };
  let frames = 0;
  let lastUrl = null;
  const NAMED = new Set(["Enter", "Tab", "Backspace", "Delete", "Escape", "ArrowLeft", "ArrowUp",
    "ArrowRight", "ArrowDown", "Home", "End", "PageUp", "PageDown"]);

  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(proto + "//" + location.host + location.pathname.replace(/\/$/, "") + "/ws");
  ws.binaryType = "blob";

  function send(msg) {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(msg));
  }

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
      address.textContent = msg.url;
      size = { w: msg.w, h: msg.h };
      img.width = msg.w;
      img.height = msg.h;
      refused.textContent = msg.refused && msg.refused.length
        ? "Refused (outside this login's allowed sites): " + msg.refused.join(", ") : "";
    } else if (msg.t === "ended") {
      status.textContent = "(ended: " + msg.state + ")";
      document.body.dataset.ended = msg.state;
    }
  };
  ws.onopen = function () { status.textContent = "(live)"; document.body.dataset.live = "1"; };
  ws.onclose = function () { if (!document.body.dataset.ended) status.textContent = "(disconnected)"; };

  function point(ev) {
    const r = keys.getBoundingClientRect();
    return { x: (ev.clientX - r.left) * size.w / r.width, y: (ev.clientY - r.top) * size.h / r.height };
  }
  function mods(ev) {
    return (ev.altKey ? 1 : 0) | (ev.ctrlKey ? 2 : 0) | (ev.metaKey ? 4 : 0) | (ev.shiftKey ? 8 : 0);
  }
  const BUTTON = ["left", "middle", "right"];
  keys.addEventListener("mousedown", function (ev) {
    keys.focus();
    const p = point(ev);
    send({ t: "mouse", type: "mousePressed", x: p.x, y: p.y, button: BUTTON[ev.button] || "left",
      clickCount: ev.detail || 1, modifiers: mods(ev) });
    ev.preventDefault();
  });
  keys.addEventListener("mouseup", function (ev) {
    const p = point(ev);
    send({ t: "mouse", type: "mouseReleased", x: p.x, y: p.y, button: BUTTON[ev.button] || "left",
      clickCount: ev.detail || 1, modifiers: mods(ev) });
  });
  let lastMove = 0;
  keys.addEventListener("mousemove", function (ev) {
    const now = Date.now();
    if (now - lastMove < 40) return;
    lastMove = now;
    const p = point(ev);
    send({ t: "mouse", type: "mouseMoved", x: p.x, y: p.y, modifiers: mods(ev) });
  });
  keys.addEventListener("wheel", function (ev) {
    const p = point(ev);
    send({ t: "wheel", x: p.x, y: p.y, dx: ev.deltaX, dy: ev.deltaY });
    ev.preventDefault();
  }, { passive: false });
  keys.addEventListener("contextmenu", function (ev) { ev.preventDefault(); });
  keys.addEventListener("keydown", function (ev) {
    if (NAMED.has(ev.key)) {
      send({ t: "key", type: "keyDown", key: ev.key, modifiers: mods(ev) });
      ev.preventDefault();
    }
  });
  keys.addEventListener("keyup", function (ev) {
    if (NAMED.has(ev.key)) {
      send({ t: "key", type: "keyUp", key: ev.key, modifiers: mods(ev) });
      ev.preventDefault();
    }
  });
  // Printable text (typed, composed or inserted) arrives as input: forwarded as text.
  keys.addEventListener("input", function () {
    if (keys.value) send({ t: "text", text: keys.value });
    keys.value = "";
  });
  paste.addEventListener("submit", function (ev) {
    ev.preventDefault();
    if (pasteText.value) send({ t: "text", text: pasteText.value });
    pasteText.value = "";
    keys.focus();
  });
  // The address box asks the login tab to open an address; the guard lets the tab go only to
  // this login's allowed sites (a refusal shows under the address).
  go.addEventListener("submit", function (ev) {
    ev.preventDefault();
    const url = goUrl.value.trim();
    if (url) send({ t: "navigate", url: url });
    keys.focus();
  });
  let resizeTimer = null;
  function fit() {
    const wrap = document.getElementById("screen-wrap");
    const w = Math.max(320, Math.min(1920, Math.floor(wrap.clientWidth)));
    const h = Math.max(240, Math.min(1200, Math.floor(window.innerHeight * 0.7)));
    if (Math.abs(w - size.w) > 8 || Math.abs(h - size.h) > 8) send({ t: "resize", w: w, h: h });
  }
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(fit, 250);
  });
})();
