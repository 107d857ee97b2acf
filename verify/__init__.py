"""tensoralg.verify: independent checks of tensoralg's exactness claims.

Installed as ``tensoralg.verify`` (the repository keeps it in the top-level ``verify/`` folder;
``pyproject.toml`` maps the name), so that a ``verify.py`` of the user's own cannot shadow it.

Nothing here calls tensoralg's fast paths (``inner``, ``similarity``, ``gram``, the tensor
network or Wick code). Everything is recomputed from definitions:

* [`tensoralg.verify.symbolic`][verify.symbolic] — sympy proofs of the identities (polarization,
  Isserlis, the lifted / non-centred Isserlis rule, the single-layer Gram closed form, invariances)
  on small cases; ``python -m tensoralg.verify`` runs them all.
* [`tensoralg.verify.certify`][verify.certify] — exact rational certificate of functional
  equivalence of two networks by polynomial expansion
  ([`tensoralg.verify.certify`][verify.certify]).
* [`tensoralg.verify.montecarlo`][verify.montecarlo] — sampling estimates with standard errors,
  convergence reports and z-score agreement checks.
* [`tensoralg.verify.attention`][verify.attention] — brute-force rational polynomial expansion of
  small sequence models (bilinear attention) and their exact Gaussian inner products.
* [`tensoralg.verify.paths`][verify.paths] — the first-order path expansion of a small
  transformer (``tensoralg.decompose.paths``) against the model's polynomial with one gain symbol
  per head, output bias and MLP, in sympy's exact polynomial ring.
* [`tensoralg.verify.quadrature`][verify.quadrature] — exact Gauss–Hermite quadrature of inner
  products, similarities and Wiener-chaos (Hermite order) profiles on low-dimensional Gaussian
  slices of any network, from the forward pass alone; [`tensoralg.verify.planted`][verify.planted] —
  planted high-dimensional models (reads and writes along one direction) whose full inner product is
  such a slice.

``import tensoralg.verify`` is cheap: it loads only [`tensoralg.verify.certify`][verify.certify]
(numpy); ``symbolic`` (sympy), ``montecarlo``, ``quadrature`` and ``planted`` load on first use, and
``tensoralg.verify.identifiability`` is never imported here (``attention`` and ``paths`` load on
first use too).
"""

from __future__ import annotations

import importlib

__all__ = ["certify", "Certificate", "gaussian_inner_exact", "expand", "ExpansionTooLarge",
           "symbolic", "montecarlo", "quadrature", "planted"]

from ._poly import ExpansionTooLarge
from .certify import Certificate, certify, expand, gaussian_inner_exact  # binds the function


def __getattr__(name: str):
    if name in ("symbolic", "montecarlo", "identifiability", "attention", "quadrature",
                "planted", "paths"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
