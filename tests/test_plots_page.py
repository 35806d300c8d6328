"""The offline page of `dvc plots show` (pipeline/plots_page.py, .dvc/plots.html)."""

import configparser
import re
from pathlib import Path

import pytest

from pipeline import plots_page

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / ".dvc" / "plots.html"


def test_dvc_config_names_the_committed_template():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".dvc" / "config")
    assert (ROOT / ".dvc" / cfg["plots"]["html_template"].strip()) == TEMPLATE
    assert TEMPLATE.is_file()


def test_the_committed_template_is_what_the_module_writes():
    """Regenerated from the pinned vl-convert-python, the page is byte for byte the committed one."""
    pytest.importorskip("vl_convert")
    assert plots_page.page() == TEMPLATE.read_text(encoding="utf-8")


def test_dvc_fills_the_template_without_any_network_script(tmp_path):
    """DVC's renderer on the committed template: the chart's div and spec are in, vegaEmbed is defined inline,
    and no <script src=...> (DVC's default page loads three from a CDN) nor a {placeholder} is left."""
    from dvc_render import render_html
    from dvc_render.vega import VegaRenderer

    rows = [{"round": r, "fedavg": a, "rev": "workspace", "filename": "report/test_acc.csv", "field": "fedavg"}
            for r, a in ((1, 0.5), (2, 0.7))]
    renderer = VegaRenderer(rows, "report/test_acc.csv", x="round", y="fedavg", template="linear")
    out = Path(render_html([renderer], tmp_path / "index.html", html_template=str(TEMPLATE)))
    html = out.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc=", html)
    assert "cdn.jsdelivr" not in html
    assert "window.vegaEmbed" in html and "vegaEmbed('#" in html and '"fedavg"' in html
    assert not re.search(r"\{(plot_divs|scripts|refresh_tag)\}", html)


def test_missing_library_is_one_line(monkeypatch, capsys, tmp_path):
    import builtins

    real = builtins.__import__

    def no_vl(name, *a, **k):
        if name == "vl_convert":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_vl)
    assert plots_page.main(["--out", str(tmp_path / "p.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vl-convert-python" in err
    assert not (tmp_path / "p.html").exists()
