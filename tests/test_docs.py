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

The site: ``mkdocs build --strict`` (mkdocs.yml) into a temporary folder, once per session, so a
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
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
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


def test_api_reference_has_no_raw_roles_or_unresolved_references(site):
    found = []
    for html in sorted(site.rglob("*.html")):
        # code is not prose: f[t][o] in a code span is an index, not a reference
        text = CODE.sub(r"\1\3", html.read_text(encoding="utf-8"))
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
