// Keeps the status page live: every few seconds it fetches the page again and swaps in the
// new <main id="live">. The server renders everything (one renderer, and the page reads
// without script); this only refreshes, and says so when the service stops answering.
"use strict";
(() => {
  const everyMs = 1000 * Number(document.body.dataset.refreshS || "2");
  const note = document.getElementById("updated");
  let refreshes = 0;

  async function refresh() {
    try {
      if (!document.hidden) {
        const response = await fetch(window.location.pathname, { cache: "no-store" });
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        const page = new DOMParser().parseFromString(await response.text(), "text/html");
        const live = page.getElementById("live");
        if (!live) throw new Error("the page has no live section");
        document.getElementById("live").replaceWith(document.adoptNode(live));
        refreshes += 1;
        document.body.dataset.refreshes = String(refreshes);
        note.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
        note.className = "ok";
      }
    } catch (err) {
      note.textContent = `not updating: ${err.message}`;
      note.className = "stale";
    } finally {
      setTimeout(refresh, everyMs);
    }
  }

  setTimeout(refresh, everyMs);
})();
