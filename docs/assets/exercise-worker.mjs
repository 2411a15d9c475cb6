// Runs an exercise's tests with pytest inside Pyodide, off the page's main thread.
// Everything is loaded from this site: ./pyodide/ holds the interpreter and the wheels
// (docs/hooks/browser.py copies them there), the page sends the exercise's bundle.
import { loadPyodide } from "./pyodide/pyodide.mjs";

const RUNTIME = new URL("./pyodide/", import.meta.url).href;
let pyodide = null;  // one interpreter per worker, booted on the first run
let output = [];     // what pytest printed during the current run
const written = new Set();  // bundles already in the file system

async function boot() {
  const py = await loadPyodide({
    indexURL: RUNTIME,
    packages: [],
    stdout: (line) => output.push(line),
    stderr: (line) => output.push(line),
  });
  const runtime = await (await fetch(RUNTIME + "runtime.json")).json();
  py.FS.mkdirTree("/runtime/wheels");
  for (const wheel of runtime.wheels) {
    const bytes = await (await fetch(RUNTIME + "wheels/" + wheel)).arrayBuffer();
    py.FS.writeFile("/runtime/wheels/" + wheel, new Uint8Array(bytes));
  }
  // Pure-Python wheels are zip files: unpacking them onto sys.path installs them.
  await py.runPythonAsync(`
import importlib, os, sys, zipfile
for name in sorted(os.listdir("/runtime/wheels")):
    zipfile.ZipFile("/runtime/wheels/" + name).extractall("/runtime/site")
sys.path.insert(0, "/runtime/site")
importlib.invalidate_caches()
`);
  return py;
}

function writeBundle(py, bundle) {
  const root = "/exercises/" + bundle.exercise;
  if (!written.has(bundle.exercise)) {
    for (const [path, text] of Object.entries(bundle.files)) {
      const full = root + "/" + path;
      py.FS.mkdirTree(full.slice(0, full.lastIndexOf("/")));
      py.FS.writeFile(full, text);
    }
    written.add(bundle.exercise);
  }
  return root;
}

self.onmessage = async ({ data }) => {
  const { bundle, code } = data;
  try {
    if (pyodide === null) {
      self.postMessage({ kind: "status", text: "Loading Python (about 15 MB, once)…" });
      pyodide = await boot();
    }
    const root = writeBundle(pyodide, bundle);
    self.postMessage({ kind: "status", text: "Running the tests…" });
    output = [];
    const scope = pyodide.toPy({ root, file: bundle.file, code, answer: bundle.engine_answer });
    const json = await pyodide.runPythonAsync(`
import sys
if root not in sys.path:
    sys.path.insert(0, root)
import browser_run
browser_run.run(root, file, code, answer)
`, { globals: scope });
    scope.destroy();
    self.postMessage({ kind: "done", results: JSON.parse(json), output: output.join("\n") });
  } catch (err) {
    self.postMessage({ kind: "error", text: String(err && err.message || err),
                       output: output.join("\n") });
  }
};
