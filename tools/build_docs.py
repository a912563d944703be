"""``make docs``: the site, built offline, in ``site/``.

    python tools/build_docs.py                 # every notebook executed now, then mkdocs build
    python tools/build_docs.py --only 02_gradient_accumulation   # just those notebooks (the test's build)

mkdocs with mkdocstrings (the API reference from the docstrings) and mkdocs-jupyter (the notebooks as pages):
one well-kept toolchain for Markdown pages, an API reference and notebooks with their outputs, building to static
files that open without a server or a network. The pages are ``docs/*.md`` as they are; the notebooks are executed
here (nbclient, the notebooks' own folder as the working directory, offline), so the site shows what this
version of nbtrain draws; each plotly figure gets a local copy of plotly.js instead of the CDN's, so it stays
interactive offline. Everything is assembled in ``build/docs-src`` and mkdocs.yml reads it from there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "build" / "docs-src"
PLOTLY_MIME = "application/vnd.plotly.v1+json"

# The API reference: the public names of `import nbtrain as nbt`, where they are defined.
API = [
    ("Configuration", ["nbtrain.TrainConfig"]),
    ("Training", ["nbtrain.train", "nbtrain.start", "nbtrain.engine.loop.Run", "nbtrain.TrainResult",
                  "nbtrain.StepRecord", "nbtrain.EvalRecord", "nbtrain.SampleRecord", "nbtrain.RunInfo",
                  "nbtrain.StopTraining", "nbtrain.CallbackError"]),
    ("Comparing", ["nbtrain.compare", "nbtrain.ComparisonResult"]),
    ("The device and memory", ["nbtrain.capabilities", "nbtrain.Capabilities", "nbtrain.memory.estimate_memory",
                               "nbtrain.memory.MemoryEstimate"]),
    ("In a notebook", ["nbtrain.viz.dashboard.LiveDashboard", "nbtrain.ui.panel.Panel"]),
]


def api_page() -> str:
    lines = ["# API reference", "", "Everything below is reached as `import nbtrain as nbt` (`nbt.train`, "
             "`nbt.TrainConfig`, ...). Generated from the docstrings.", ""]
    for title, names in API:
        lines += [f"## {title}", ""]
        for name in names:
            lines += [f"::: {name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


def execute(path: Path, out: Path, timeout: int) -> float:
    """Run the notebook at ``path`` top to bottom (its folder as the working directory) and save it at ``out``
    with its outputs; the seconds it took."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    # no widget state saved: drawing it would need the ipywidgets manager from a CDN; what a run leaves in a saved
    # notebook is its static figure (plotly JSON + HTML), drawn below with the site's plotly.js
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=False,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    offline_figures(nb, depth=1)
    nbformat.write(nb, out)
    return time.perf_counter() - t0


def offline_figures(nb, depth: int) -> int:
    """Give each plotly output HTML that loads plotly.js from the site (the first figure of the page) instead of
    the CDN; returns how many outputs were rewritten."""
    import plotly.io as pio

    src = "../" * depth + "assets/plotly.min.js"
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME not in data:
                continue
            fig = data[PLOTLY_MIME]
            html = pio.to_html(fig, full_html=False, include_plotlyjs=src if n == 0 else False,
                               config=fig.get("config") or {"responsive": True, "displaylogo": False})
            data["text/html"] = html
            data.pop(PLOTLY_MIME)   # the HTML exporter would otherwise prefer the JSON it cannot draw
            n += 1
    return n


# nbconvert's page template loads the ipywidgets HTML manager from unpkg on every notebook page, widgets or not;
# the notebooks are saved without widget state (their figures are static plotly), so that script only fails offline
_WIDGETS_LOADER = re.compile(r"<script>\s*\(function\(\) \{\s*function addWidgetsRenderer\(\).*?\}\(\)\);\s*</script>",
                             re.S)


def offline_pages(site: Path) -> int:
    """Drop the widgets loader from the notebook pages that hold no widget state; how many pages changed."""
    n = 0
    for page in (site / "notebooks").glob("*.html"):
        source = SRC / "notebooks" / (page.stem + ".ipynb")
        if source.is_file() and "widgets" in json.loads(source.read_text()).get("metadata", {}):
            continue   # saved widget state: the loader draws it
        text = page.read_text()
        new = _WIDGETS_LOADER.sub("", text)
        if new != text:
            page.write_text(new)
            n += 1
    return n


def assemble(only: list[str] | None, execute_notebooks: bool, timeout: int) -> list[str]:
    """build/docs-src: the pages, the API page, plotly.js and the notebooks; the notebooks' names."""
    import plotly

    shutil.rmtree(SRC, ignore_errors=True)
    shutil.copytree(ROOT / "docs", SRC)
    # the pages link the notebooks and the measured results as they sit in the repo (../notebooks/...); in the
    # site both sit beside the pages
    shutil.copytree(ROOT / "benchmarks" / "results", SRC / "benchmarks" / "results",
                    ignore=shutil.ignore_patterns("*.png"))
    for page in SRC.glob("*.md"):
        text = page.read_text()
        page.write_text(text.replace("](../notebooks/", "](notebooks/").replace("](../benchmarks/", "](benchmarks/")
                       .replace("](../nbtrain/", "](nbtrain/"))
    (SRC / "api.md").write_text(api_page())
    (SRC / "assets").mkdir(exist_ok=True)
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", SRC / "assets" / "plotly.min.js")
    shutil.copytree(ROOT / "nbtrain" / "configs", SRC / "nbtrain" / "configs")
    (SRC / "notebooks").mkdir(exist_ok=True)
    names = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if only and path.stem not in only:
            continue
        out = SRC / "notebooks" / path.name
        if execute_notebooks:
            seconds = execute(path, out, timeout)
            print(f"executed {path.name} in {seconds:.0f} s", flush=True)
        else:
            shutil.copy(path, out)
        names.append(path.stem)
    return names


PAGES = [("Home", "index.md"), ("Precision", "precision.md"), ("Memory", "memory.md"),
         ("How nbtrain measures memory", "memory-model.md"), ("Speed", "speed.md"),
         ("Chat and preference tuning", "chat-and-preference.md"), ("More than one GPU", "distributed.md"),
         ("Evidence", "evidence.md"), ("API reference", "api.md"), ("For contributors", "architecture.md")]


def write_config(notebooks: list[str], partial: bool = False) -> Path:
    """build/mkdocs.yml: the repo's mkdocs.yml plus the nav (the pages that exist, then the notebooks). A partial
    build (``--only``) lets the pages' links to the notebooks left out go unresolved."""
    nav = [f"  - {title!r}: {page}" for title, page in PAGES if (SRC / page).exists()]
    if notebooks:
        nav.append("  - Notebooks:")
        nav += [f"      - {name.replace('_', ' ', 1).replace('_', ' ')!r}: notebooks/{name}.ipynb"
                for name in notebooks]
    path = SRC.parent / "mkdocs.yml"
    extra = "validation:\n  links:\n    not_found: info\n" if partial else ""
    path.write_text("INHERIT: ../mkdocs.yml\ndocs_dir: docs-src\n" + extra + "nav:\n" + "\n".join(nav) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="notebook names (stems) to include; default all")
    ap.add_argument("--no-execute", action="store_true", help="take the notebooks as they are stored")
    ap.add_argument("--site", default=str(ROOT / "site"), help="where the site goes")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a notebook cell may take")
    args = ap.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "NO_MKDOCS_2_WARNING": "1"}   # material's notice about a future mkdocs, not about this site
    os.environ.update(env)
    names = assemble(args.only, not args.no_execute, args.timeout)
    config = write_config(names, partial=bool(args.only))
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", args.site]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc == 0:
        offline_pages(Path(args.site))
        print(json.dumps({"site": args.site, "notebooks": names}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
