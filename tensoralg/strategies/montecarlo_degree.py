"""Monte Carlo on the degree-``<= K`` truncations of two networks (docs/mathematics.md §3.9;
APPROXIMATE), for [`tensoralg.degree_similarity`][tensoralg.degree_similarity] where no exact path
applies.

The radial estimator of `tensoralg.strategies.montecarlo` on the truncation. Per
direction ``theta`` the parts ``P_k(rho theta)`` come from the DFT
(`tensoralg.homogeneous.dft_parts`: ``m`` complex forward passes per input scale of
`MC_SCALES`, each part read at the scale of smallest rounding bound) at the typical
radius ``rho = sqrt(D)``, and ``f_{<=K}(r theta) = sum_k (r/rho)^k P_k(rho theta)``, so the
radial integral is exact given the chi moments ``E[r^n]`` (antithetic ``±theta``: odd ``k + l``
cancel). The largest exact lower truncation is the control variate (its exact inner products
replace its sample means). Diagnostics as `tensoralg.strategies.montecarlo` (three
replicates, their agreement, the largest single-direction share — here of the sampled
remainder against the whole sum, so that the exact block does not dilute a heavy tail): an
estimate whose ``reliable`` is False is not an answer.
"""

from __future__ import annotations

import math

import numpy as np

from ..homogeneous import dft_parts
from .montecarlo import (
    MC_CHUNK_ELEMENTS,
    MonteCarloEstimate,
    inner_diagnostics,
    ratio_diagnostics,
    ratio_estimate,
    verdict,
)

__all__ = ["MC_SCALES", "truncation_estimates"]


def _chi_ratio(D: int, n: int, rho: float) -> float:
    """``E[r^n] / rho^n`` for ``r ~ chi_D``."""
    return math.exp(0.5 * n * math.log(2) + math.lgamma((D + n) / 2) - math.lgamma(D / 2)
                    - n * math.log(rho))


#: Input scales of the Monte Carlo DFT (fewer than
#: `tensoralg.homogeneous.DFT_SCALES`: 3 x (degree + 1)
#: forward passes per direction and model).
MC_SCALES = (1.0, 0.125, 0.015625)


def truncation_estimates(na, nb, n_ctx, Ks, exact_lower, n_samples, seed, kmax_profile,
                         need=(None, None), chunk=4096):
    """Per-direction triples for each ``K`` in ``Ks`` and per-degree norms (radial estimator on
    the DFT parts). ``exact_lower[K] = (K0, (ab, aa, bb))``: the control variate; ``need``:
    per model the degrees whose norm is wanted (None: all up to ``kmax_profile``)."""
    d = na.in_features
    shape = (d,) if n_ctx is None else (n_ctx, d)
    D = int(np.prod(shape))
    rho = math.sqrt(D)
    ma, mb = na.degree + 1, nb.degree + 1
    kk = max(max(Ks), kmax_profile)
    ka, kb = min(kk, na.degree), min(kk, nb.degree)
    c = np.array([_chi_ratio(D, n, rho) if n % 2 == 0 else 0.0 for n in range(2 * kk + 1)])
    rng = np.random.default_rng(seed)
    out = (n_ctx or 1) * na.out_features
    # directions per chunk: at most ``chunk`` evaluations and about MC_CHUNK_ELEMENTS complex
    # entries of input or output per DFT (a (64, 256) context took 12 GB at 682 a chunk)
    size = max(1, min(chunk // max(ma, mb), MC_CHUNK_ELEMENTS // (max(ma, mb) * max(D, out))))
    trip = {K: [] for K in Ks}
    cv = {K: [] for K in exact_lower}
    prof = ([], [])
    done = 0
    while done < n_samples:
        s = min(size, n_samples - done)
        u = rng.standard_normal((s, D))
        u *= rho / np.linalg.norm(u, axis=1, keepdims=True)
        X = u.reshape((s,) + shape)
        Pa = dft_parts(na, X, ma, MC_SCALES)[:ka + 1].reshape(ka + 1, s, -1)
        Pb = dft_parts(nb, X, mb, MC_SCALES)[:kb + 1].reshape(kb + 1, s, -1)
        Gab = np.einsum("ksx,lsx->skl", Pa, Pb)
        Gaa = np.einsum("ksx,lsx->skl", Pa, Pa)
        Gbb = np.einsum("ksx,lsx->skl", Pb, Pb)

        def trunc(G, K):
            i = np.arange(min(K, G.shape[1] - 1) + 1)
            j = np.arange(min(K, G.shape[2] - 1) + 1)
            C = c[i[:, None] + j[None, :]]
            return np.einsum("skl,kl->s", G[:, :i.size, :j.size], C)

        for K in Ks:
            trip[K].append(np.stack([trunc(Gab, K), trunc(Gaa, K), trunc(Gbb, K)]))
        for K, (K0, _) in exact_lower.items():
            cv[K].append(np.stack([trunc(Gab, K0), trunc(Gaa, K0), trunc(Gbb, K0)]))
        for side, G, kx in ((0, Gaa, ka), (1, Gbb, kb)):
            k = np.arange(min(kx, kmax_profile) + 1)
            prof[side].append(G[:, k, k] * c[2 * k][None, :])
        done += s
    out = {}
    for K in Ks:
        P = np.concatenate(trip[K], axis=1)
        raw = P
        if K in exact_lower:
            rem = P - np.concatenate(cv[K], axis=1)      # the sampled remainder
            P = rem + np.asarray(exact_lower[K][1])[:, None]
        else:
            rem = P
        est = ratio_estimate(P.sum(axis=1), P @ P.T, P.shape[1])
        diag = ratio_diagnostics(P)
        # the largest share is one direction's remainder against the whole sum (the exact
        # block is not sampled, so it must not dilute a heavy-tailed remainder); the certified
        # lower bounds come from the raw (non-negative) per-direction norms
        tot = np.abs(raw).sum(axis=1)
        share = float(max(np.abs(rem[i]).max() / tot[i] if tot[i] > 0 else 1.0
                          for i in range(3)))
        diag = verdict(list(diag.replicates), share, {"<a,a>": raw[1], "<b,b>": raw[2]},
                        diag.exact)
        out[K] = MonteCarloEstimate(float(est), est.stderr, P.shape[1], diag)
    profs = []
    for side in (0, 1):
        Z = np.concatenate(prof[side], axis=0)
        ks = [k for k in range(Z.shape[1]) if need[side] is None or k in need[side]]
        profs.append({k: MonteCarloEstimate(float(Z[:, k].mean()),
                                            float(Z[:, k].std(ddof=1) / math.sqrt(Z.shape[0])),
                                            Z.shape[0], inner_diagnostics(Z[:, k], "<P,P>"))
                      for k in ks})
    return out, profs
