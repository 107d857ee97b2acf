// Typesets the formulas pymdownx.arithmatex (generic mode) leaves as \( … \) and \[ … \] in
// <span class="arithmatex"> / <div class="arithmatex">, with the KaTeX shipped in ../katex/
// (no CDN: the site works offline). document$ is mkdocs-material's page-load observable, so
// formulas are typeset again after instant navigation.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
