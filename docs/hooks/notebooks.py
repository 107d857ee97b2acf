"""MkDocs hook: publish the teaching notebooks of ``proofs_notebooks/`` on the site.

The notebooks stay where they are (CI runs them there, ``tests/test_notebooks.py``); this hook
adds each ``proofs_notebooks/NN_name.ipynb`` to the site as ``notebooks/NN_name.ipynb`` (so
``docs/notebooks.md`` links to ``notebooks/NN_name.ipynb``), before the mkdocs-jupyter plugin turns
``.ipynb`` files into pages, and lists them in the nav under "Teaching notebooks", titled by
their first heading up to its colon; each page opens with a link to download the ``.ipynb``
(``include_source`` copies it beside the page). A new notebook is published and listed without
editing ``mkdocs.yml``.

When mkdocs-jupyter executes the notebooks (``execute:`` in ``mkdocs.yml``, on unless
``TENSORALG_DOCS_EXECUTE=false``), their kernels inherit this process's environment: the
figures need matplotlib's inline backend, which ``MPLBACKEND=Agg`` (CI's setting, under which a
figure is drawn and discarded) would replace, so the hook sets it for the kernels.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "proofs_notebooks"
SECTION = "Teaching notebooks"
INLINE = "module://matplotlib_inline.backend_inline"


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _title(path: Path) -> str:
    """'01 · Polarization' from the first cell's '# 01 · Polarization: a polynomial ...'."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    source = "".join(cells[0]["source"]) if cells else ""
    heading = next((line[2:] for line in source.splitlines() if line.startswith("# ")), path.stem)
    title = re.split(r":\s", heading, maxsplit=1)[0]
    title = re.sub(r"^(\d\d)\s+[—–-]\s+", r"\1 · ", title)   # '04 — SAEs' as '04 · SAEs'
    return re.sub(r"[*_`]", "", title).strip()


def on_config(config):
    jupyter = config.plugins.get("mkdocs-jupyter")
    if jupyter is not None and jupyter.config["execute"]:
        os.environ["MPLBACKEND"] = INLINE
    entries = [{_title(p): f"notebooks/{p.name}"} for p in _notebooks()]
    sections = [item for part in config.nav or [] for item in _walk(part)
                if isinstance(item, dict) and SECTION in item]
    if len(sections) != 1 or not isinstance(sections[0][SECTION], list):
        raise ValueError(f"mkdocs.yml: the nav needs one section {SECTION!r} (a list) to hold "
                         f"the notebooks; found {len(sections)}")
    sections[0][SECTION].extend(entries)
    return config


def _walk(item):
    yield item
    children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
    for child in children:
        yield from _walk(child)


def _uri(path: Path) -> str:
    return f"notebooks/{path.name}"


@event_priority(100)   # before mkdocs-jupyter's on_files, which makes .ipynb files pages
def on_files(files, config):
    for path in _notebooks():
        files.append(File.generated(config, _uri(path), abs_src_path=str(path)))
    return files


def on_nav(nav, config, files):
    # mkdocs-jupyter's wrapper recomputes the source path from a folder and the site path, which
    # a file added from outside docs/ does not have: give it the notebook's path again (the
    # notebook then runs in proofs_notebooks/, as in CI)
    for path in _notebooks():
        files.get_file_from_path(_uri(path)).abs_src_path = str(path)
    return nav


# a notebook's link to a page of the site, written for a reader of the repository
DOCS_LINK = re.compile(r'href="\.\./docs/([^"#]+\.md)(#[^"]*)?"')
# a notebook's link to another notebook (beside it in proofs_notebooks/): on the site, its page
NB_LINK = re.compile(r'href="(?:\./|\.\./proofs_notebooks/)?(\d\d_\w+\.ipynb)(#[^"]*)?"')
# nbconvert's page template loads MathJax and (for diagrams, which these notebooks do not have)
# mermaid from a CDN; the site typesets the notebooks' formulas with its own KaTeX (katex.js)
# and loads nothing from the network, so both are dropped
CDN_SCRIPTS = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->"
                         r"|<script type=\"module\">(?:(?!</script>).)*?mermaid.*?</script>", re.S)


def on_page_content(html, page, config, files):
    """The notebooks link to the guides as ``../docs/page.md`` and to each other as
    ``NN_name.ipynb`` (right in a clone and on GitHub); on the site those are the pages' URLs. A
    link to a page that does not exist fails the build. Each page opens with a download link."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html

    def site_link(m):
        target = files.get_file_from_path(m.group(1))
        if target is None:
            raise ValueError(f"{page.file.src_uri}: a link to ../docs/{m.group(1)}, which is not "
                             f"a page of the site")
        return f'href="{target.url_relative_to(page.file)}{m.group(2) or ""}"'

    def notebook_link(m):
        target = files.get_file_from_path(f"notebooks/{m.group(1)}")
        if target is None:
            raise ValueError(f"{page.file.src_uri}: a link to the notebook {m.group(1)}, which "
                             f"proofs_notebooks/ does not have")
        return f'href="{target.url_relative_to(page.file)}{m.group(2) or ""}"'

    html = NB_LINK.sub(notebook_link, html)
    name = Path(page.file.abs_src_path).name   # mkdocs-jupyter copies it beside the page
    source = (f'<p class="nb-source"><em>Download</em> <a href="{name}" download>{name}</a> '
              f'(committed without outputs: open it in Jupyter and run all cells, or read it '
              f'here with its outputs)</p>\n')
    return source + CDN_SCRIPTS.sub("", DOCS_LINK.sub(site_link, html))
