"""The HTML report renders in a real browser: headless Chromium draws its plots."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TAB_BLUE = np.array([31, 119, 180]) / 255  # matplotlib's first colour: the float32 points


def cli(*args):
    result = subprocess.run([sys.executable, "-m", "conformance", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode in (0, 1), result.stderr[-2000:]
    return result


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_report_renders_its_plots_in_headless_chromium(tmp_path):
    import matplotlib.image

    report, bench, page = tmp_path / "r.json", tmp_path / "b.json", tmp_path / "r.html"
    cli("run", "--backend", "numpy", "--backend", "tests.planted:WindowOffByOne", "--profile",
        "smoke", "--report-json", str(report))
    cli("bench", "--backend", "numpy", "--shapes", "cpu", "--rounds", "1", "--report-json",
        str(bench))
    cli("html", "--report-json", str(report), "--bench-json", str(bench), "--out", str(page))
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 2 and "FAIL" in text
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2000",
                    f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True,
                   timeout=120)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1400)
    ink = np.abs(pixels - 1.0).sum(axis=-1) > 0.3  # not the white background
    assert ink.mean() > 0.02
    plotted = np.abs(pixels - TAB_BLUE).sum(axis=-1) < 0.1
    assert plotted.sum() > 200, "the error plot's points did not render"


def test_html_report_says_what_ran_where_and_the_accuracy_table(tmp_path):
    import json

    from conformance.html_report import render

    report = tmp_path / "r.json"
    cli("run", "--backend", "numpy", "--profile", "smoke", "-k", "sinks/", "--report-json",
        str(report))
    data = json.loads(report.read_text())
    page = render(data)
    assert "What ran where" in page and data["machine"]["platform"] in page
    assert "numpy " + data["machine"]["libraries"]["numpy"] in page
    assert "--report-json" in page and data["backends"][0]["description"][:30] in page
    assert "Accuracy (worst error / budget" in page
    worst = max((r for r in data["results"] if r["check"] == "oracle/output"),
                key=lambda r: r["error"] / r["budget"])
    assert f"<td>{worst['error']:.3g}</td>" in page
