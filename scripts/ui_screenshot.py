"""Screenshot of the MLflow UI's chart page of a parent run (the seed-mean curves), for docs/tracking.md.

    .venv/bin/python scripts/ui_screenshot.py [--out docs/img/mlflow_parent.png] [--rounds 10] [--seeds 2]
                                              [--chromium /usr/bin/chromium] [--size 1280,800] [--keep DIR]

Builds a throwaway project folder (a temporary directory): one experiment of the default setting (digits,
FedAvg, shards) with ``--seeds`` seeds and ``--rounds`` rounds through ``pipeline.api.run(..., write=True)``, so it
has its own ``mlflow.db`` and ``mlartifacts/``; starts ``mlflow ui`` on it on a free port of 127.0.0.1 (as
``make ui`` does); saves a screenshot of the parent run's "Model metrics" page taken by headless Chromium, driven
by Playwright (``pip install -e '.[docs]'``; Playwright's own browsers are not needed); stops the UI and removes
the folder (``--keep DIR`` copies it to DIR first). Needs Chromium (Debian: ``apt-get install -y chromium``);
without it, or without Playwright, the script stops with one line before training. Exit status 0, or 2 (one
``error:`` line: no Chromium, no Playwright, the UI did not start, the page did not render).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

#: headless Chromium without a sandbox (containers), GPU, network chatter or first-run screens
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


class Failed(Exception):
    """A step failed; the message is the one line the script prints."""


def find_chromium(given: str | None) -> str:
    """The Chromium executable: ``given``, else ``chromium`` / ``chromium-browser`` / ``google-chrome`` on PATH.

    Raises:
        Failed: none is found.
    """
    for name in ([given] if given else ["chromium", "chromium-browser", "google-chrome"]):
        path = shutil.which(name)
        if path:
            return path
    raise Failed(f"{given or 'chromium'} not found: install it (Debian: apt-get install -y chromium) or give "
                 "--chromium PATH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_store(project: Path, rounds: int, seeds: int) -> tuple:
    """Train one small experiment in ``project`` (its own ./mlflow.db); returns (experiment id, parent run id)."""
    from pipeline.api import run

    here, env = Path.cwd(), os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.chdir(project)
    try:
        result = run([f"train.rounds={rounds}", "engine.progress=false", "name=fedavg_demo"],
                     seeds=tuple(range(1, seeds + 1)), write=True)
    finally:
        os.chdir(here)
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env
    from mlflow.tracking import MlflowClient

    parent = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(result.summary["mlflow_run_id"])
    return parent.info.experiment_id, parent.info.run_id


def start_ui(project: Path, port: int, log: Path) -> subprocess.Popen:
    """``mlflow ui`` on the project's store, as ``make ui`` starts it, in a process group of its own."""
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow) if mlflow.exists() else "mlflow", "ui", "--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}",
           "--artifacts-destination", str(project / "mlartifacts"), "--serve-artifacts", "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return subprocess.Popen(cmd, cwd=project, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Wait until ``url``/health answers OK.

    Raises:
        Failed: the UI exited or did not answer within ``timeout_s``.
    """
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise Failed(f"mlflow ui exited with status {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise Failed(f"mlflow ui did not answer at {url}/health within {timeout_s:.0f} s")


def screenshot(chromium: str, url: str, out: Path, size: str, scale: float = 0.8) -> None:
    """Save the chart page at ``url`` to ``out`` (``size`` = ``W,H`` image pixels) with Playwright driving
    ``chromium`` (headless, a fresh profile): the page is laid out ``1/scale`` times as large (more charts fit),
    MLflow's assistant panel that opens on a first visit is closed and the ``comm`` section collapsed, so the
    accuracy and loss curves come first.

    Raises:
        Failed: Playwright is not installed, or the page did not show its charts within two minutes.
    """
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise Failed("playwright is not installed: .venv/bin/pip install -e '.[docs]'") from None
    w, h = (int(v) for v in size.split(","))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True,
                                        args=[f for f in CHROMIUM_FLAGS if f != "--headless"])
            try:
                page = browser.new_page(viewport={"width": round(w / scale), "height": round(h / scale)},
                                        device_scale_factor=scale)
                page.goto(url, wait_until="load", timeout=120_000)
                comm = page.get_by_text("comm", exact=True)  # a section header: the charts' data is in
                comm.wait_for(timeout=120_000)
                close = page.get_by_role("button", name="Close")
                if close.count():
                    close.first.click()
                comm.click()
                page.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
                page.wait_for_timeout(3000)  # the charts below the first draw their lines
                page.screenshot(path=str(tmp))
            finally:
                browser.close()
    except PlaywrightError as err:
        raise Failed(f"the chart page did not render: {str(err).strip().splitlines()[0][:200]}") from None
    os.replace(tmp, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "mlflow_parent.png")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--chromium", default=None, help="the Chromium executable (default: chromium on PATH)")
    p.add_argument("--size", default="1280,800", help="image size W,H in pixels")
    p.add_argument("--keep", type=Path, default=None, help="copy the throwaway project folder here before removing it")
    args = p.parse_args(argv)
    proc = None
    with tempfile.TemporaryDirectory(prefix="fl-ui-") as tmp_name:
        tmp = Path(tmp_name)
        project = tmp / "project"
        project.mkdir()
        try:
            chromium = find_chromium(args.chromium)
            if importlib.util.find_spec("playwright") is None:
                raise Failed("playwright is not installed: .venv/bin/pip install -e '.[docs]'")
            print(f"training {args.seeds} seed(s) x {args.rounds} rounds in {project} ...", file=sys.stderr)
            exp_id, parent_id = build_store(project, args.rounds, args.seeds)
            port = free_port()
            proc = start_ui(project, port, tmp / "ui.log")
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, proc)
            url = f"{base}/#/experiments/{exp_id}/runs/{parent_id}/model-metrics?workflowType=machine_learning"
            screenshot(chromium, url, args.out, args.size)
            print(f"{args.out}: {url}", file=sys.stderr)
        except Failed as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            if args.keep is not None:
                shutil.copytree(project, args.keep, dirs_exist_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
