// Typesets the formulas pymdownx.arithmatex (generic mode) leaves as \( … \) and \[ … \] in
// <span class="arithmatex"> / <div class="arithmatex">, with the KaTeX shipped in ../katex/
// (no CDN: the site works offline). document$ is mkdocs-material's page-load observable, so
// formulas are typeset again after instant navigation.
//
// The teaching notebooks (mkdocs-jupyter pages, in .jupyter-wrapper) write their formulas as
// Jupyter does, $ … $ and $$ … $$, which nbconvert leaves in the page as text: they are typeset
// first, with those delimiters, inside the notebooks only (a $ elsewhere stays a dollar). Code
// and outputs (<pre>, <code>) are never typeset (auto-render's ignoredTags).
document$.subscribe(({ body }) => {
  body.querySelectorAll(".jupyter-wrapper").forEach((notebook) => {
    renderMathInElement(notebook, {
      delimiters: [
        { left: "$$", right: "$$", display: true },
        { left: "$", right: "$", display: false },
      ],
      throwOnError: false,
    });
  });
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
