"""`snakemake --report` shows every report figure with its caption, checked in a browser.

A copy of the workflow gets hand-written stage outputs at its plan's paths (tests/report_testing.py:
four variants, two seed replicates among them), so Snakemake runs only the real report stage and
the variant views (a few seconds, where the smoke pipeline takes minutes), then writes the HTML
report. Snakemake 9's report is a React app holding every file as a data URI; headless Chromium
(Debian's package, installed here when missing, like tests/slurm/local_cluster.py installs Slurm)
opens it with a probe script that clicks through the app as a reader would: the Results menu item,
each figure's view button (the app then shows an <img> of the data URI, which must decode to the
figure's size) and its info button (the caption must appear). A screenshot of the last figure
shown, with its caption, is saved under the test's tmp directory and its path printed.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from report_testing import TABLE, write_outputs
from snakemake_testing import copy_repo, job_counts

from posttrain.workflow.schema import load_config
from posttrain.workflow.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT_FIGURE = "stage_effects"
WINDOW = (1920, 1200)
CAPTION_PREFIX = 60  # characters of each caption's text that must be on the page after its info click

# Runs after the report's own scripts: clicks through the app, then leaves its findings as JSON in
# <pre id="figure-check"> for --dump-dom (the figure named in the URL's #fragment is handled last).
PROBE = """<script>
(async function () {
  const sleep = (ms) => new Promise((done) => setTimeout(done, ms));
  async function until(find, what) {
    for (let i = 0; i < 400; i++) { const found = find(); if (found) return found; await sleep(25); }
    throw new Error("timed out waiting for " + what);
  }
  const text = (s) => s.replace(/\\s+/g, " ").trim();
  const found = {figures: {}, error: null};
  try {
    const resultsLink = await until(() => [...document.querySelectorAll("#app a")]
      .find((a) => a.textContent.trim() === "Results"), "the Results menu item");
    const target = decodeURIComponent(location.hash.slice(1));
    const figures = Object.entries(results).filter(([path, r]) => r.mime_type === "image/png")
      .sort(([, a], [, b]) => (a.labels.file === target) - (b.labels.file === target));
    const buttons = async (result) => {
      const row = await until(() => [...document.querySelectorAll("#app tr")]
        .find((tr) => tr.cells.length && tr.cells[0].textContent.trim() === result.labels.file),
        "the row of " + result.name);
      return row.querySelectorAll("a");
    };
    resultsLink.click();
    for (const [path, result] of figures) {
      (await buttons(result))[0].click();
      const img = await until(() => [...document.querySelectorAll("#app img")]
        .find((i) => i.getAttribute("src") === result.data_uri && i.complete), "the image of " + result.name);
      const box = img.getBoundingClientRect();
      found.figures[result.name] = {naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
                                    shownWidth: box.width, shownHeight: box.height};
    }
    for (const [path, result] of figures) {
      app.showCategory(Object.keys(categories)[0]);  // what the Results menu item does (one category)
      (await buttons(result))[1].click();
      const caption = document.createElement("div");
      caption.innerHTML = result.caption;
      const expected = text(caption.textContent).slice(0, %(prefix)d);
      await sleep(100);
      found.figures[result.name].caption = text(document.querySelector("#app").textContent).includes(expected);
    }
  } catch (err) {
    found.error = String(err);
  }
  const out = document.createElement("pre");
  out.id = "figure-check";
  out.style.display = "none";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
})();
</script>
""" % {"prefix": CAPTION_PREFIX}


def chromium_unavailable() -> str | None:
    """Why Chromium cannot be used here, or None (installed, or root on Debian with apt-get)."""
    if CHROMIUM.exists():
        return None
    if os.geteuid() != 0:
        return f"{CHROMIUM} is missing and installing Debian's chromium package needs root"
    if not Path("/etc/debian_version").exists() or shutil.which("apt-get") is None:
        return f"{CHROMIUM} is missing and this is not Debian with apt-get to install chromium"
    return None


def install_chromium() -> None:
    """apt-get install Debian's chromium when it is missing (apt-get update only if the install fails)."""
    if CHROMIUM.exists():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]  # waits for another test's install (tests/slurm)
    command = [*apt, "install", "-y", "-q", "--no-install-recommends", "chromium"]
    if subprocess.run(command, env=env, capture_output=True, text=True).returncode != 0:
        subprocess.run([*apt, "update", "-q"], env=env, check=True, capture_output=True)
        subprocess.run(command, env=env, check=True, capture_output=True)


def chromium(page: Path, profile: Path, *args: str, fragment: str = "") -> str:
    """Headless Chromium on a local page, nothing fetched from the network; returns its stdout."""
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=60000",
               *args, page.as_uri() + (f"#{fragment}" if fragment else "")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    return struct.unpack(">II", path.read_bytes()[16:24])


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """A workflow copy whose results hold hand-written stage outputs, the report stage's real output
    and Snakemake's HTML report of them."""
    root = tmp_path_factory.mktemp("report_html")
    copy_repo(root, ("Snakefile", "workflow", "envs", "profiles", "config", "stages", "posttrain"))
    (root / "ablations.tsv").write_text(TABLE)
    results = root / "results"
    overrides = {"results": str(results), "ablations": str(root / "ablations.tsv")}
    write_outputs(build_plan(load_config(root / "config" / "config.yaml", overrides=overrides),
                             schema_dir=root / "workflow" / "schemas", repo=root))  # keys cover the copy's code
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    base = [sys.executable, "-m", "snakemake", "--cores", "1", "--config", *(f"{k}={v}" for k, v in overrides.items())]

    def snakemake(*args: str) -> str:
        done = subprocess.run([*base, *args], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    # Every stage output is in place: only the report and the variant views are left to run.
    assert job_counts(snakemake("--dry-run")) == {"report": 1, "variant": 4, "all": 1}
    snakemake()
    snakemake("--report", str(root / "report.html"))
    return root


@pytest.fixture(scope="module")
def browser():
    reason = chromium_unavailable()
    if reason:
        pytest.skip(reason)
    install_chromium()
    return CHROMIUM


def embedded_results(page: Path) -> dict:
    match = re.search(r'<script id="results">\s*var results = (.*?);\s*</script>', page.read_text(), re.S)
    assert match, f"{page}: no results script"
    return json.loads(match.group(1))


def test_report_embeds_every_report_file_with_its_caption(workflow):
    report_dir = workflow / "results" / "report"
    figures = sorted(p.name for p in report_dir.glob("*.png"))
    assert figures == ["eval_metrics.png", "objective_curves.png", "stage_effects.png"]
    results = {Path(path).name: entry for path, entry in embedded_results(workflow / "report.html").items()}
    assert sorted(results) == sorted([*figures, "effects.tsv", "stage_times.tsv", "summary.tsv", "machine.json"])  # not posttrain.json
    for name, entry in results.items():
        payload = entry["data_uri"].split(";base64,", 1)[1]
        assert base64.b64decode(payload) == (report_dir / name).read_bytes(), name
        assert entry["caption"] and "Report output" not in entry["caption"], name  # its own caption, not the fallback


def test_every_figure_renders_in_chromium(workflow, browser, tmp_path):
    page = tmp_path / "probe.html"
    head, body_end, tail = (workflow / "report.html").read_text().rpartition("</body>")  # a bundled library
    page.write_text(head + PROBE + body_end + tail)  # holds "</body>" in a string too: only the last one closes
    dom = chromium(page, tmp_path / "profile", "--dump-dom")
    match = re.search(r'<pre id="figure-check"[^>]*>(.*?)</pre>', dom, re.S)
    assert match, dom[-2000:]
    found = json.loads(html.unescape(match.group(1)))
    assert found["error"] is None, found
    report_dir = workflow / "results" / "report"
    figures = sorted(p.name for p in report_dir.glob("*.png"))
    assert sorted(found["figures"]) == figures
    for name, seen in found["figures"].items():
        width, height = png_size(report_dir / name)
        assert (seen["naturalWidth"], seen["naturalHeight"]) == (width, height), (name, seen)
        assert seen["shownWidth"] > 0 and seen["shownHeight"] > 0, (name, seen)
        assert seen["caption"], (name, "caption not shown")

    screenshot = tmp_path / "report_screenshot.png"
    chromium(page, tmp_path / "profile", f"--screenshot={screenshot}", "--hide-scrollbars",
             fragment=SCREENSHOT_FIGURE)
    print(f"report screenshot ({SCREENSHOT_FIGURE}.png with its caption): {screenshot}")
    image = matplotlib.image.imread(screenshot)
    assert image.shape[:2] == (WINDOW[1], WINDOW[0]) and image[..., :3].std() > 0.05
