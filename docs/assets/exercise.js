// The in-browser runner of the practice pages: an editor holding the learner's file, "Run the
// tests" (pytest in Pyodide, in exercise-worker.mjs), "Reset", and one line per test.
(function () {
  "use strict";
  const ASSETS = new URL(".", document.currentScript.src).href;
  const MARK = { passed: "✓", failed: "✗", skipped: "–" };

  function storageKey(name) { return "minisgl-exercise:" + name; }

  function setUp(box) {
    const name = box.dataset.exercise;
    const editor = box.querySelector(".exercise-editor");
    const runButton = box.querySelector(".exercise-run");
    const resetButton = box.querySelector(".exercise-reset");
    const status = box.querySelector(".exercise-status");
    const list = box.querySelector(".exercise-results");
    const output = box.querySelector(".exercise-output pre");
    let bundle = null;
    let worker = null;

    const stackSwitching = typeof WebAssembly !== "undefined" &&
      typeof WebAssembly.Suspending === "function";
    if (!stackSwitching && box.dataset.asyncio === "true") {
      status.textContent = "This browser lacks WebAssembly stack switching, which these asyncio " +
        "tests need: use the local judge, or Chrome/Edge 137+.";
    }

    function show(state, text) {
      box.dataset.state = state;
      if (text !== undefined) status.textContent = text;
    }

    fetch(ASSETS + "exercises/" + name + ".json")
      .then((reply) => { if (!reply.ok) throw new Error(reply.status); return reply.json(); })
      .then((data) => {
        bundle = data;
        const saved = window.localStorage.getItem(storageKey(name));
        editor.value = saved !== null ? saved : bundle.starter;
        show("ready");
      })
      .catch((err) => show("error", "Could not load the exercise: " + err.message));

    editor.addEventListener("input", () =>
      window.localStorage.setItem(storageKey(name), editor.value));
    editor.addEventListener("keydown", (event) => {
      if (event.key !== "Tab" || event.shiftKey) return;
      event.preventDefault();
      editor.setRangeText("    ", editor.selectionStart, editor.selectionEnd, "end");
      window.localStorage.setItem(storageKey(name), editor.value);
    });

    resetButton.addEventListener("click", () => {
      if (bundle === null) return;
      editor.value = bundle.starter;
      window.localStorage.removeItem(storageKey(name));
      list.replaceChildren();
      show("ready", "Reset to the starter.");
    });

    runButton.addEventListener("click", () => {
      if (bundle === null || box.dataset.state === "running") return;
      if (worker === null) {
        worker = new Worker(ASSETS + "exercise-worker.mjs", { type: "module" });
        worker.onmessage = ({ data }) => {
          if (data.kind === "status") { status.textContent = data.text; return; }
          output.textContent = data.output || "";
          if (data.kind === "error") { show("error", "The run failed: " + data.text); return; }
          render(data.results);
        };
      }
      list.replaceChildren();
      show("running", "Starting…");
      worker.postMessage({ bundle, code: editor.value });
    });

    function render(results) {
      const count = (outcome) => results.filter((r) => r.outcome === outcome).length;
      for (const r of results) {
        const item = document.createElement("li");
        item.className = "exercise-result exercise-" + r.outcome;
        item.dataset.outcome = r.outcome;
        const head = document.createElement("code");
        head.textContent = MARK[r.outcome] + " " + r.name;
        item.append(head);
        const values = Object.entries(r.values || {}).map(([k, v]) => `  ${k} = ${v}`);
        if (r.message || values.length) {
          const why = document.createElement("pre");
          why.textContent = r.message + (values.length ?
            "\nthe test's values when it failed (its input, expected, actual):\n" +
            values.join("\n") : "");
          item.append(why);
        }
        list.append(item);
      }
      const skipped = count("skipped");
      show("done", `${count("passed")}/${results.length} tests passed` +
        (skipped ? `, ${skipped} skipped (they need PyTorch: run the local judge)` : "") +
        (count("failed") ? "" : ". Well done."));
    }
  }

  function start() { document.querySelectorAll(".exercise-runner").forEach(setUp); }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
