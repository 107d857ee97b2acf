"""The documentation: the site builds in strict mode, and every code block in README.md and
docs/**/*.md runs.

Code blocks (parsed by Sybil, https://sybil.readthedocs.io):

* ```` ```python ```` blocks are executed, each page's blocks in order in one namespace, in a
  temporary working directory (a page is one test, so pytest-xdist keeps its blocks together).
* ```` ```bash ```` blocks are run with ``bash -euo pipefail`` in that directory, with this
  interpreter's ``bin/`` first on ``PATH`` and the repository on ``PYTHONPATH``; each must
  finish within ``SHELL_TIMEOUT_S`` seconds with exit status 0.
* A block that must not run (a training, an audit, an install, a command that needs files the
  page does not make) is preceded by the HTML comment ``<!-- skip: next "reason" -->`` (Sybil's
  skip directive; the reason is a Python string and is required here). A page may not skip
  every block it has silently: each skip is counted and must carry its reason.
* Blocks in any other language (``text``, ``json``, ``toml``, ``yaml``) are shown, not run; a
  fence without a language is an error, so that no runnable code hides in an untagged block.

The site: ``mkdocs build --strict`` (mkdocs.yml) into a temporary folder, once per session (the
teaching notebooks as pages, not executed here: ``TENSORALG_DOCS_EXECUTE=false``), so a
broken link, a page missing from the nav, an API reference (mkdocstrings) or a cross-reference
(``[`name`][tensoralg.module.name]``, autorefs) that does not resolve fails the test; and no page
of the built HTML may show a raw Sphinx role (``:class:`` …), which the Google-style renderer
prints as text.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import SkipTest

import pytest
import sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
SHELL_TIMEOUT_S = 60
SHOWN_LANGUAGES = {"python", "bash", "text", "json", "toml", "yaml"}
FENCE = re.compile(r"^[ \t]*(```+|~~~+)[ \t]*([^\s`]*)", re.M)
SKIP = re.compile(r"<!--\s*skip:\s*next(.*?)-->", re.S)


def _shell_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, "1")
    return env


def _run_shell(example) -> None:
    source = str(example.parsed)
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", source], env=_shell_env(),
                              capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{example.path}:{example.line}: shell block ran past "
                             f"{SHELL_TIMEOUT_S} s; mark it <!-- skip: next \"reason\" -->") from None
    if done.returncode != 0:
        raise AssertionError(f"{example.path}:{example.line}: exit {done.returncode}\n"
                             f"$ {source}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


PARSERS = [PythonCodeBlockParser(), CodeBlockParser("bash", _run_shell), SkipParser()]


def _fences(text: str) -> list[str]:
    """The language of every opening fence of ``text`` (closing fences dropped)."""
    langs, open_fence = [], None
    for m in FENCE.finditer(text):
        if open_fence is None:
            open_fence = m.group(1)
            langs.append(m.group(2))
        elif m.group(1).startswith(open_fence) and not m.group(2):
            open_fence = None
    assert open_fence is None, "an unclosed code fence"
    return langs


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_code_blocks_run(page, tmp_path, monkeypatch):
    text = page.read_text(encoding="utf-8")
    langs = _fences(text)
    unknown = [lang or "(none)" for lang in langs if lang not in SHOWN_LANGUAGES]
    assert not unknown, f"{page.name}: code fences with languages {unknown}; use one of " \
                        f"{sorted(SHOWN_LANGUAGES)}"
    for m in SKIP.finditer(text):
        assert re.fullmatch(r"\s*(\"[^\"]+\"|'[^']+')\s*", m.group(1)), \
            f"{page.name}: a skip without a quoted reason: {m.group(0)!r}"

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    document = sybil.Document.parse(str(page), *PARSERS)
    ran = skipped = 0
    for example in document:
        if example.region.evaluator is PARSERS[2].skipper:  # the skip directive itself
            example.evaluate()
            continue
        try:
            example.evaluate()
            ran += 1
        except SkipTest:
            skipped += 1
    runnable = langs.count("python") + langs.count("bash")
    assert ran + skipped == runnable, f"{page.name}: {runnable} python/bash fences, Sybil saw " \
                                      f"{ran + skipped} (a fence the parser does not read?)"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once per session of this module: ``mkdocs build --strict`` into a
    temporary folder. Not ``--quiet``: it drops warnings before strict mode counts them, so an
    unresolved cross-reference or a docstring griffe cannot parse would pass unseen."""
    out = tmp_path_factory.mktemp("site") / "site"
    # the notebooks' pages without running them (tests/test_notebooks.py runs every notebook;
    # test_a_notebook_page_shows_its_outputs_and_figures below checks the executed rendering)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", TENSORALG_DOCS_EXECUTE="false",
               TENSORALG_DOCS_CACHE_DIR=str(tmp_path_factory.mktemp("nbcache")))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    warnings = [line for line in (done.stdout + done.stderr).splitlines()
                if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, "\n".join(warnings) or \
        done.stdout[-5000:] + done.stderr[-5000:]
    return out


def test_site_builds_strict(site):
    assert (site / "reference" / "tensoralg" / "index.html").exists()
    # the formulas are typeset offline: arithmatex's output and the KaTeX shipped with the site
    for asset in ("assets/katex/katex.min.js", "assets/katex/katex.min.css",
                  "assets/katex/contrib/auto-render.min.js",
                  "assets/katex/fonts/KaTeX_Main-Regular.woff2"):
        assert (site / asset).is_file(), asset
    page = (site / "mathematics" / "index.html").read_text(encoding="utf-8")
    assert 'class="arithmatex"' in page
    assert "cdn" not in re.sub(r"<code.*?</code>", "", page, flags=re.S).lower()


# a Sphinx role left in a docstring (the Google-style renderer prints it as text), before or
# after Markdown turned its backticks into <code>
RAW_ROLE = re.compile(r":(class|func|meth|mod|attr|data|exc|obj):(`|<code>)")
# a mkdocstrings cross-reference autorefs did not resolve: [`name`][identifier] left as text
UNRESOLVED = re.compile(r"\]\[[A-Za-z_][\w.]*\]")
CODE = re.compile(r"(<code[^>]*>)(.*?)(</code>)", re.S)
# code blocks and style sheets are not prose either (a notebook's cells are highlighted <pre>
# blocks without <code>, each with a plain copy in a clipboard-copy-txt <div>; its page carries
# JupyterLab's CSS, full of [class*=...][readonly])
BLOCKS = re.compile(r'(<(pre|style)[^>]*>|<(div) class="clipboard-copy-txt"[^>]*>)(.*?)(</(?:\2|\3)>)',
                    re.S)


def test_api_reference_has_no_raw_roles_or_unresolved_references(site):
    found = []
    for html in sorted(site.rglob("*.html")):
        # code is not prose: f[t][o] in a code span is an index, not a reference
        text = CODE.sub(r"\1\3", BLOCKS.sub(r"\1\5", html.read_text(encoding="utf-8")))
        for pattern in (RAW_ROLE, UNRESOLVED):
            found += [f"{html.relative_to(site)}: {text[max(0, m.start() - 60):m.end() + 20]!r}"
                      for m in pattern.finditer(text)]
    assert not found, "\n".join(found[:20])


def test_the_checks_above_can_fail():
    """The two patterns find what they are for (so the test above is not vacuous)."""
    assert RAW_ROLE.search("see :class:`Foo`") and RAW_ROLE.search("see :func:<code>f</code>")
    assert UNRESOLVED.search("see [<code>f</code>][tensoralg.nope]")
    assert not UNRESOLVED.search('<a href="x">[1]</a>')
    assert UNRESOLVED.search(CODE.sub(r"\1\3", "[<code>f</code>][tensoralg.nope]"))
    assert not UNRESOLVED.search(CODE.sub(r"\1\3", "<code>f[t][o]</code>"))
    assert RAW_ROLE.search(CODE.sub(r"\1\3", ":class:<code>Foo</code>"))
    assert not UNRESOLVED.search(BLOCKS.sub(r"\1\5", "<pre>L[perm][swap]</pre><style>.a[b][c]</style>"
                                                     '<div class="clipboard-copy-txt">L[p][s]</div>'))
    assert UNRESOLVED.search(BLOCKS.sub(r"\1\5", "<pre>x</pre> [<code>f</code>][tensoralg.nope]"))


NOTEBOOKS = sorted((ROOT / "proofs_notebooks").glob("[0-9][0-9]_*.ipynb"))
# what may mention a CDN without loading from it: code, and images inlined as data: URIs
INERT = re.compile(r"<code[^>]*>.*?</code>|data:image/[a-z+]+;base64,[A-Za-z0-9+/=]+", re.S)


def test_the_notebooks_are_pages_of_the_site(site):
    """Every notebook of proofs_notebooks/ is a page (docs/hooks/notebooks.py), in the nav and
    linked from the notebooks page, with its .ipynb beside it to download; its links to the
    guides point at the site's pages, and nothing on it loads from a CDN (nbconvert's MathJax and
    mermaid scripts are dropped; the site's KaTeX typesets the notebooks' formulas)."""
    assert len(NOTEBOOKS) >= 10
    index = (site / "notebooks" / "index.html").read_text(encoding="utf-8")
    for nb in NOTEBOOKS:
        folder = site / "notebooks" / nb.stem
        html = (folder / "index.html").read_text(encoding="utf-8")
        assert (folder / nb.name).is_file(), nb.name
        assert f'href="{nb.name}" download' in html, nb.name
        assert f'href="{nb.stem}/"' in index, f"notebooks.md or the nav does not link {nb.name}"
        assert 'class="jupyter-wrapper"' in html and "../docs/" not in html, nb.name
        assert "cdn" not in INERT.sub("", html).lower(), nb.name
        if "../docs/" in nb.read_text(encoding="utf-8"):   # its links to the guides, rewritten
            assert re.search(r'href="\.\./\.\./[a-z_]+/', html), nb.name


def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nbhook", ROOT / "docs" / "hooks" / "notebooks.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_the_hook_turns_a_notebooks_links_into_site_links(monkeypatch):
    """A notebook's links written for the repository (``../docs/page.md``, ``NN_name.ipynb``)
    become the pages' URLs; a link to a notebook or page that does not exist fails the build."""
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    monkeypatch.setenv("TENSORALG_DOCS_EXECUTE", "false")
    hook, config = _hook(), load_config(str(ROOT / "mkdocs.yml"))
    config.plugins._current_plugin = None       # set by mkdocs while it runs a plugin's event
    files = config.plugins["mkdocs-jupyter"].on_files(hook.on_files(get_files(config), config),
                                                     config)
    hook.on_nav(None, config, files)
    page = type("Page", (), {"file": files.get_file_from_path(f"notebooks/{NOTEBOOKS[-1].name}")})
    html = hook.on_page_content(f'<a href="{NOTEBOOKS[0].name}#s">n</a> '
                                f'<a href="../docs/results/sae.md#x">r</a>', page, config, files)
    assert f'<a href="../{NOTEBOOKS[0].stem}/#s">n</a>' in html
    assert '<a href="../../results/sae/#x">r</a>' in html
    for bad in ('<a href="99_none.ipynb">', '<a href="../docs/none.md">'):
        with pytest.raises(ValueError, match="does not have|not a page"):
            hook.on_page_content(bad, page, config, files)


def test_the_published_build_executes_the_notebooks(monkeypatch):
    """mkdocs.yml runs the notebooks unless TENSORALG_DOCS_EXECUTE says not to, so that a plain
    ``mkdocs build`` (the published site) shows their outputs."""
    from mkdocs.config import load_config

    monkeypatch.delenv("TENSORALG_DOCS_EXECUTE", raising=False)
    plugin = load_config(str(ROOT / "mkdocs.yml")).plugins["mkdocs-jupyter"]
    assert plugin.config["execute"] is True and plugin.config["allow_errors"] is False
    monkeypatch.setenv("TENSORALG_DOCS_EXECUTE", "false")
    assert load_config(str(ROOT / "mkdocs.yml")).plugins["mkdocs-jupyter"].config["execute"] is False


def test_a_notebook_page_shows_its_outputs_and_figures(monkeypatch):
    """The build's rendering of a notebook, executed as the published build does: the hook
    switches the kernels to matplotlib's inline backend (CI's MPLBACKEND=Agg would draw every
    figure and keep none), and the page carries the printed results and the figures as PNG.
    Notebook 01, the cheapest (about 4 CPU-s)."""
    from mkdocs.config import load_config
    from mkdocs_jupyter.convert import nb2html

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("TENSORALG_DOCS_EXECUTE", raising=False)
    hook = _hook()
    hook.on_config(load_config(str(ROOT / "mkdocs.yml")))
    assert os.environ["MPLBACKEND"] == hook.INLINE
    html = nb2html(str(ROOT / "proofs_notebooks" / "01_polarization.ipynb"), execute=True,
                   allow_errors=False, custom_mathjax_url="")
    # figures (JupyterLab's CSS inlines PNG icons too, hence the <img>); none under Agg
    assert len(re.findall(r'<img[^>]*src="data:image/png', html)) >= 1
    assert "jp-OutputArea-output" in html and "Traceback" not in html


def test_nothing_cites_the_design_file_outside_the_repository():
    """The mathematics the code, tests and docs cite is in docs/mathematics.md: no file of the
    repository points at ../shared/DESIGN.md, which a clone does not have."""
    cited = []
    for folder in ("tensoralg", "verify", "tests", "benchmarks", "docs", "examples"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".ipynb") and path.name != "test_docs.py":
                text = path.read_text(encoding="utf-8", errors="replace")
                cited += [f"{path.relative_to(ROOT)}:{i + 1}"
                          for i, line in enumerate(text.splitlines()) if "DESIGN.md" in line]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cited += [f"README.md:{i + 1}" for i, line in enumerate(readme.splitlines())
              if "DESIGN.md" in line]
    assert not cited, cited
