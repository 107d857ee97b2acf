"""Data-based and weight-based baselines to put next to tensor similarity.

* `LinearCKA` / `linear_cka` — linear centred kernel alignment (Kornblith et al.
  2019, "Similarity of Neural Network Representations Revisited"), with the biased HSIC
  estimator ``||Xc^T Yc||_F^2 / (n-1)^2`` (Gretton et al. 2005) or the unbiased one of Song et al.
  2012 ("Feature selection via dependence maximization", eq. 5), both computed in *feature
  space* from running float64 sums, so data can be streamed in batches of any size.
* `weight_cosine` — cosine of the flattened parameter vectors of two same-architecture
  models (not invariant to any weight symmetry; the naive baseline).
* `output_cosine` — mean over samples of the cosine between the two logit vectors.
* `js_divergence` — mean over samples of the Jensen–Shannon divergence (natural log,
  in ``[0, ln 2]``) between the two softmax distributions (Lin 1991, via ``scipy.stats.entropy``).
* `per_class_baselines` — the behavioural baselines per class on labelled data: logit and
  probability cosine restricted to each class's samples, prediction agreement, each model's
  accuracy, and the data analogue of a class-slice similarity (cosine of one output over all
  samples).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["LinearCKA", "linear_cka", "weight_cosine", "output_cosine", "js_divergence",
           "model_outputs", "hidden_features", "all_baselines", "per_class_baselines",
           "DegenerateInputWarning"]


class DegenerateInputWarning(RuntimeWarning):
    """A baseline is undefined on this input (e.g. a constant representation) and is NaN."""


def _as_float64_2d(a: Any, name: str) -> np.ndarray:
    if type(a).__module__.startswith("torch"):
        a = a.detach().to("cpu").double().numpy()
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a (n, features) array, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        bad = int(a.size - np.count_nonzero(np.isfinite(a)))
        raise ValueError(f"{name}: {bad} non-finite (NaN/inf) entries in an array of shape "
                         f"{a.shape}")
    return a


class _Cross:
    """Running sums for the pair (X, Y): all that the centred biased and unbiased HSIC need."""

    def __init__(self, p: int, q: int):
        self.A = np.zeros((p, q))          # sum x y^T
        self.sx = np.zeros(p)              # sum x
        self.sy = np.zeros(q)              # sum y
        self.Sa = 0.0                      # sum ||x||^2
        self.Sb = 0.0                      # sum ||y||^2
        self.Sab = 0.0                     # sum ||x||^2 ||y||^2
        self.Say = np.zeros(q)             # sum ||x||^2 y
        self.Sbx = np.zeros(p)             # sum ||y||^2 x

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        a = np.einsum("ij,ij->i", x, x)
        b = np.einsum("ij,ij->i", y, y)
        self.A += x.T @ y
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.Sa += a.sum()
        self.Sb += b.sum()
        self.Sab += a @ b
        self.Say += a @ y
        self.Sbx += b @ x

    def hsic(self, n: int, debiased: bool) -> float:
        """``||Xc^T Yc||_F^2`` scaled as an HSIC estimate, with ``Xc`` the exactly centred data.

        Row norms of the centred data: ``|x_i - m|^2 = a_i - 2 x_i.m + |m|^2``; expanding the sums
        over ``i`` gives everything in terms of the running sums (derivation in the tests)."""
        mx, my = self.sx / n, self.sy / n
        cx, cy = mx @ mx, my @ my
        Ac = self.A - n * np.outer(mx, my)
        xty = float(np.sum(Ac * Ac))
        if not debiased:
            return xty / (n - 1) ** 2
        # sum_i |xc_i|^2 |yc_i|^2
        row_dot = (self.Sab - 2 * self.Say @ my - 2 * self.Sbx @ mx + 4 * mx @ self.A @ my
                   + cy * self.Sa + cx * self.Sb - 3 * n * cx * cy)
        sq_x = self.Sa - n * cx
        sq_y = self.Sb - n * cy
        # Song et al. (2012) unbiased HSIC with linear kernels on centred features, in the
        # feature-space form of Kornblith et al. (2019), times 1 / (n (n - 3)).
        val = xty - n / (n - 2.0) * row_dot + sq_x * sq_y / ((n - 1.0) * (n - 2.0))
        return val / (n * (n - 3.0))


class LinearCKA:
    """Streaming linear CKA between representations ``X`` ``(n, p)`` and ``Y`` ``(n, q)``.

    ``CKA = HSIC(X, Y) / sqrt(HSIC(X, X) HSIC(Y, Y))`` with linear kernels; rows are paired
    samples. Feed batches with `update`; read `value`. Sums are float64; each batch
    is shifted by the first batch's column means (CKA is translation invariant) to limit
    cancellation.

    Degenerate input: a batch with NaN/inf or mismatched shapes raises ``ValueError`` *before*
    anything is accumulated (the accumulator stays usable). `value` raises ``ValueError``
    with fewer than 2 (biased) or 4 (debiased) samples, and returns NaN with a
    `DegenerateInputWarning` when a representation has no variance (zero self-HSIC) or
    the unbiased self-HSIC estimate is not positive (possible for tiny ``n``).
    """

    def __init__(self):
        self.n = 0
        self._shift = None

    def update(self, X: Any, Y: Any) -> LinearCKA:
        X = _as_float64_2d(X, "X")
        Y = _as_float64_2d(Y, "Y")
        if len(X) != len(Y):
            raise ValueError(f"X, Y: need paired rows, got {X.shape[0]} and {Y.shape[0]} samples")
        if len(X) == 0:
            return self
        if self._shift is None:
            self._shift = (X.mean(0), Y.mean(0))
            p, q = X.shape[1], Y.shape[1]
            self._xy, self._xx, self._yy = _Cross(p, q), _Cross(p, p), _Cross(q, q)
        elif (X.shape[1], Y.shape[1]) != (len(self._shift[0]), len(self._shift[1])):
            raise ValueError(f"X, Y: feature sizes {X.shape[1]}, {Y.shape[1]} differ from the "
                             f"earlier batches' {len(self._shift[0])}, {len(self._shift[1])}")
        X = X - self._shift[0]
        Y = Y - self._shift[1]
        self._xy.update(X, Y)
        self._xx.update(X, X)
        self._yy.update(Y, Y)
        self.n += len(X)
        return self

    def value(self, debiased: bool = False) -> float:
        need = 4 if debiased else 2
        if self.n < need:
            raise ValueError(f"linear CKA ({'debiased' if debiased else 'biased'}) needs at least "
                             f"{need} samples, got {self.n}")
        xy = self._xy.hsic(self.n, debiased)
        xx = self._xx.hsic(self.n, debiased)
        yy = self._yy.hsic(self.n, debiased)
        # zero variance: relative to the raw second moments, so rounding noise counts as zero
        scale_x = max(self._xx.Sa, 1e-300)
        scale_y = max(self._yy.Sa, 1e-300)
        tol = 1e-12
        if xx <= tol * scale_x ** 2 / self.n ** 2 or yy <= tol * scale_y ** 2 / self.n ** 2:
            warnings.warn("linear CKA is undefined (NaN): a representation has no variance "
                          "(or a non-positive unbiased self-HSIC)", DegenerateInputWarning,
                          stacklevel=2)
            return float("nan")
        return float(xy / math.sqrt(xx * yy))


def linear_cka(X: Any, Y: Any, debiased: bool = False, batch_size: int | None = None) -> float:
    """Linear CKA of ``X`` ``(n, p)`` and ``Y`` ``(n, q)`` (see `LinearCKA`)."""
    X = _as_float64_2d(X, "X")
    Y = _as_float64_2d(Y, "Y")
    if len(X) != len(Y):
        raise ValueError(f"X, Y: need paired rows, got {X.shape[0]} and {Y.shape[0]} samples")
    acc = LinearCKA()
    step = batch_size or max(len(X), 1)
    for i in range(0, len(X), step):
        acc.update(X[i:i + step], Y[i:i + step])
    return acc.value(debiased)


def _flat_params(model: Any, name: str) -> dict[str, np.ndarray]:
    sd = model.state_dict() if hasattr(model, "state_dict") else model
    if not isinstance(sd, Mapping):
        raise TypeError(f"{name}: expected a torch module or a state_dict, got {type(model).__name__}")
    out = {}
    for k, v in sd.items():
        if type(v).__module__.startswith("torch"):
            v = v.detach().to("cpu").double().numpy()
        out[k] = np.asarray(v, dtype=np.float64)
    return out


def weight_cosine(a: Any, b: Any) -> float:
    """Cosine of the two models' parameter vectors (every tensor flattened, in name order).

    Raises:
        ValueError: different parameter names or shapes, or an all-zero parameter vector.
    """
    pa, pb = _flat_params(a, "a"), _flat_params(b, "b")
    if set(pa) != set(pb):
        raise ValueError(f"a, b: different parameters: only in a {sorted(set(pa) - set(pb))}, "
                         f"only in b {sorted(set(pb) - set(pa))}")
    for k in pa:
        if pa[k].shape != pb[k].shape:
            raise ValueError(f"a, b: parameter {k!r} has shapes {pa[k].shape} and {pb[k].shape}")
    va = np.concatenate([pa[k].ravel() for k in sorted(pa)])
    vb = np.concatenate([pb[k].ravel() for k in sorted(pb)])
    na, nb = np.linalg.norm(va), np.linalg.norm(vb)
    if na == 0 or nb == 0:
        raise ValueError("a, b: weight cosine is undefined for an all-zero parameter vector")
    return float(va @ vb / (na * nb))


def _paired(la: Any, lb: Any) -> tuple[np.ndarray, np.ndarray]:
    la = _as_float64_2d(la, "logits_a")
    lb = _as_float64_2d(lb, "logits_b")
    if la.shape != lb.shape:
        raise ValueError(f"logits_a, logits_b: shapes {la.shape} and {lb.shape} differ")
    if len(la) == 0:
        raise ValueError("logits_a, logits_b: no samples")
    return la, lb


def output_cosine(logits_a: Any, logits_b: Any) -> float:
    """Mean over samples of ``cos(logits_a[i], logits_b[i])``; inputs ``(n, k)``.

    Samples where either logit vector is exactly zero have no cosine and are skipped (with a
    `DegenerateInputWarning`); NaN if every sample is skipped.
    """
    la, lb = _paired(logits_a, logits_b)
    na, nb = np.linalg.norm(la, axis=1), np.linalg.norm(lb, axis=1)
    ok = (na > 0) & (nb > 0)
    if not ok.all():
        warnings.warn(f"output_cosine: {int((~ok).sum())} of {len(ok)} samples have an all-zero "
                      f"logit vector and are skipped", DegenerateInputWarning, stacklevel=2)
    if not ok.any():
        return float("nan")
    cos = np.einsum("ij,ij->i", la[ok], lb[ok]) / (na[ok] * nb[ok])
    return float(cos.mean())


def js_divergence(logits_a: Any, logits_b: Any) -> float:
    """Mean over samples of the Jensen–Shannon divergence (nats, in ``[0, ln 2]``) between
    ``softmax(logits_a[i])`` and ``softmax(logits_b[i])``; inputs ``(n, k)``."""
    from scipy.special import softmax
    from scipy.stats import entropy

    la, lb = _paired(logits_a, logits_b)
    pa, pb = softmax(la, axis=1), softmax(lb, axis=1)
    # JS(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2 (Lin 1991). scipy's jensenshannon returns the
    # square root and gives NaN when rounding makes the divergence of near-equal rows negative;
    # here rounding is clipped to the exact range [0, ln 2].
    js = entropy((pa + pb) / 2, axis=1) - 0.5 * (entropy(pa, axis=1) + entropy(pb, axis=1))
    return float(np.mean(np.clip(js, 0.0, math.log(2))))


def model_outputs(model: Any, X: Any, batch_size: int = 4096) -> np.ndarray:
    """Float64 outputs ``(n, d_out)`` of a torch module or a tensoralg network on ``X`` ``(n, d_in)``."""
    import torch

    if isinstance(model, torch.nn.Module):
        X = torch.as_tensor(X)
        dtype = next(model.parameters()).dtype
        outs = []
        with torch.no_grad():
            for i in range(0, len(X), batch_size):
                outs.append(model(X[i:i + batch_size].to(dtype)).double().numpy())
        return np.concatenate(outs) if outs else np.zeros((0, 0))
    return np.asarray(model(_as_float64_2d(X, "X")), dtype=np.float64)


def hidden_features(model: Any, X: Any) -> np.ndarray:
    """Float64 representation fed to the head (``(n, d_model)``) of a
    [`BilinearNet`][tensoralg.nn.BilinearNet]."""
    import torch

    X = torch.as_tensor(X).to(next(model.parameters()).dtype)
    with torch.no_grad():
        h = model.embed(X)
        for block in model.blocks:
            h = block(h)
    return h.double().numpy()


def all_baselines(a: Any, b: Any, X: Any) -> dict[str, float]:
    """Every baseline between two [`BilinearNet`][tensoralg.nn.BilinearNet] models on data ``X``:
    ``cka_logits``, ``cka_logits_debiased``, ``cka_hidden`` (biased, head input),
    ``output_cosine``, ``js_divergence``, ``weight_cosine``."""
    la, lb = model_outputs(a, X), model_outputs(b, X)
    return {
        "cka_logits": linear_cka(la, lb),
        "cka_logits_debiased": linear_cka(la, lb, debiased=True),
        "cka_hidden": linear_cka(hidden_features(a, X), hidden_features(b, X)),
        "output_cosine": output_cosine(la, lb),
        "js_divergence": js_divergence(la, lb),
        "weight_cosine": weight_cosine(a, b),
    }


def per_class_baselines(a: Any, b: Any, X: Any, y: Any,
                        n_classes: int | None = None) -> dict[str, list[float]]:
    """Behavioural similarity of two classifiers class by class, on labelled data.

    ``X`` ``(n, d_in)``, ``y`` ``(n,)`` integer labels in ``0 .. k - 1`` with ``k = n_classes``
    (default: the models' output size). With ``la``, ``lb`` the ``(n, k)`` logits
    (`model_outputs`) and ``I_c = {i : y_i = c}``, for each class ``c``:

    * ``logit_cosine[c]`` — mean over ``i in I_c`` of ``cos(la[i], lb[i])``
      (`output_cosine` restricted to class ``c``'s samples);
    * ``prob_cosine[c]`` — the same for the softmax probabilities;
    * ``agreement[c]`` — fraction of ``I_c`` where the two argmax predictions agree;
    * ``accuracy_a[c]``, ``accuracy_b[c]`` — each model's accuracy on ``I_c``;
    * ``output_slice_cosine[c]`` — over ALL ``n`` samples, the uncentred cosine of output ``c``:
      ``sum_i la[i, c] lb[i, c] / sqrt(sum_i la[i, c]^2 sum_i lb[i, c]^2)``: the class-slice
      similarity with the test data in place of the Gaussian input distribution.

    A class without samples gets NaN in the ``I_c`` quantities; an output that is zero on every
    sample gets NaN in ``output_slice_cosine``.

    Raises:
        ValueError: ``X`` and ``y`` of different lengths, ``y`` not integer or out of
            ``0 .. k - 1``, logits of different shapes, or no samples.
    """
    from scipy.special import softmax

    la, lb = _paired(model_outputs(a, X), model_outputs(b, X))
    k = la.shape[1] if n_classes is None else int(n_classes)
    if type(y).__module__.startswith("torch"):
        y = y.detach().to("cpu").numpy()
    y = np.asarray(y)
    if y.shape != (len(la),):
        raise ValueError(f"y: expected ({len(la)},) labels for X's {len(la)} samples, got "
                         f"shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y: expected integer labels, got dtype {y.dtype}")
    if y.min() < 0 or y.max() >= k:
        raise ValueError(f"y: labels must lie in 0..{k - 1}, got {int(y.min())}..{int(y.max())}")

    def cos_rows(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        nu, nv = np.linalg.norm(u, axis=1), np.linalg.norm(v, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.einsum("ij,ij->i", u, v) / (nu * nv)

    pa, pb = softmax(la, axis=1), softmax(lb, axis=1)
    lc, pc = cos_rows(la, lb), cos_rows(pa, pb)
    preds_a, preds_b = la.argmax(1), lb.argmax(1)
    out: dict[str, list[float]] = {key: [] for key in (
        "logit_cosine", "prob_cosine", "agreement", "accuracy_a", "accuracy_b",
        "output_slice_cosine")}
    for c in range(k):
        m = y == c
        none = not m.any()
        out["logit_cosine"].append(float("nan") if none else float(np.nanmean(lc[m])))
        out["prob_cosine"].append(float("nan") if none else float(np.nanmean(pc[m])))
        out["agreement"].append(float("nan") if none else float(np.mean(preds_a[m] == preds_b[m])))
        out["accuracy_a"].append(float("nan") if none else float(np.mean(preds_a[m] == c)))
        out["accuracy_b"].append(float("nan") if none else float(np.mean(preds_b[m] == c)))
        den = math.sqrt(float(la[:, c] @ la[:, c]) * float(lb[:, c] @ lb[:, c]))
        out["output_slice_cosine"].append(float(la[:, c] @ lb[:, c]) / den if den > 0
                                          else float("nan"))
    return out
