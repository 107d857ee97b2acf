"""verify: independent checks of tensoralg's exactness claims.

Nothing here calls tensoralg's fast paths (``inner``, ``similarity``, ``gram``, the tensor
network or Wick code). Everything is recomputed from definitions:

* :mod:`verify.symbolic` — sympy proofs of the identities (polarization, Isserlis, the lifted /
  non-centred Isserlis rule, the single-layer Gram closed form, invariances) on small cases;
  ``python -m verify`` runs them all.
* :func:`verify.certify` — exact rational certificate of functional equivalence of two
  networks by polynomial expansion (:mod:`verify.certify`).
* :mod:`verify.montecarlo` — sampling estimates with standard errors, convergence reports and
  z-score agreement checks.

Submodules are imported lazily, so ``import verify`` is cheap (no sympy, no matplotlib) and
does not import ``verify.identifiability``.
"""

from __future__ import annotations

import importlib

__all__ = ["certify", "Certificate", "gaussian_inner_exact", "expand", "ExpansionTooLarge",
           "symbolic", "montecarlo"]

_LAZY = {
    "certify": ("verify.certify", "certify"),
    "Certificate": ("verify.certify", "Certificate"),
    "gaussian_inner_exact": ("verify.certify", "gaussian_inner_exact"),
    "expand": ("verify.certify", "expand"),
    "ExpansionTooLarge": ("verify._poly", "ExpansionTooLarge"),
}


def __getattr__(name: str):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        if name == "certify":
            # importing verify.certify binds the submodule as attribute ``certify`` of the
            # package; the public name ``verify.certify`` is the function.
            globals()["certify"] = value
        return value
    if name in ("symbolic", "montecarlo", "identifiability"):
        return importlib.import_module(f"verify.{name}")
    raise AttributeError(f"module 'verify' has no attribute {name!r}")
