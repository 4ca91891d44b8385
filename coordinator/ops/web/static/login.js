"use strict";
// The sign-in address ``ray-profiler serve`` prints carries the token in its fragment
// (``/login#token=...``), which a browser never sends to a server: it is taken out of the
// address (and so out of the history) at once, then posted in the form's body.
(function () {
  const m = /^#token=(.+)$/.exec(window.location.hash);
  if (!m) return;
  history.replaceState(null, "", window.location.pathname);
  document.addEventListener("DOMContentLoaded", function () {
    const form = document.querySelector("form");
    form.querySelector("input[name=token]").value = decodeURIComponent(m[1]);
    form.submit();
  });
})();
