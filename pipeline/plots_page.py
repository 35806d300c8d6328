"""The page template of ``dvc plots show``, with Vega inside, so the charts open without internet.

``python -m pipeline.plots_page [--out F]`` writes ``.dvc/plots.html`` (the default; ``.dvc/config`` names it
as ``plots.html_template``). DVC's own page loads vega, vega-lite and vega-embed from a CDN, so on a machine
without internet its charts stay blank. This template carries the three libraries inline (one script in its own function scope, so its names cannot clash with the page's, built by
vl-convert-python's ``javascript_bundle``; vega, vega-lite and vega-embed are BSD-3-Clause) and leaves out
DVC's ``{scripts}`` placeholder, so the page ``dvc plots show`` writes (``dvc_plots/index.html``) makes no
network request. The file is committed; rerun this module after upgrading vl-convert-python or DVC.

Exit status: 0 written; 2 (one line on stderr) when vl-convert-python is not installed (``pip install -e
.[dev]``) or the output cannot be written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".dvc" / "plots.html"
# the Vega-Lite version DVC's templates are written for ($schema .../vega-lite/v5.json)
VEGA_LITE = "5"
# the names DVC's chart divs call (``vegaEmbed('#id', spec)``), set as globals by the bundle
EXPORTS = "window.vegaEmbed = vegaEmbed; window.vega = vega; window.vegaLite = vegaLite;"

PAGE = """<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>DVC plots</title>
    <!-- {versions}: inline, so the charts open offline (written by python -m pipeline.plots_page) -->
    <script type="text/javascript">
(() => {{
{bundle}
}})();
    </script>
    <style>
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def page() -> str:
    """The template's text: DVC's placeholders ``{plot_divs}`` and ``{refresh_tag}``, and the Vega libraries
    inline. Raises ImportError when vl-convert-python is missing."""
    import vl_convert as vlc

    versions = sorted((v for v in vlc.get_vegalite_versions() if v.split(".")[0] == VEGA_LITE),
                      key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))
    vl = versions[-1] if versions else None
    bundle = vlc.javascript_bundle(EXPORTS, vl_version=vl) if vl else vlc.javascript_bundle(EXPORTS)
    names = (f"vega {vlc.get_vega_version()}, vega-lite {vl or 'default'}, vega-embed "
             f"{vlc.get_vega_embed_version()} (BSD-3-Clause), bundled by vl-convert-python {vlc.__version__}")
    return PAGE.format(versions=names, bundle=bundle.replace("</script", "<\\/script"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.plots_page", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the template file (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    try:
        text = page()
    except ImportError:
        print("error: vl-convert-python is not installed; pip install -e '.[dev]'", file=sys.stderr)
        return 2
    try:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(args.out)
    except OSError as err:
        print(f"error: cannot write {args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({len(text) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
