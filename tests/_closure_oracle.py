"""Test oracle: the Gaussian closure of tensoralg.strategies.closure as it was at commit 942dfb0
(one opt_einsum contraction per partial matching of all the forms of two terms, full output
moments at every stage). Kept verbatim (only imports adapted; the node decomposition is
imported) so the fast closure can be compared against it in the same test run; not part of the package."""

from __future__ import annotations

import math  # noqa: F401
import numbers
from typing import Any

import numpy as np
import opt_einsum as oe

from tensoralg.layers import Layer
from tensoralg.prepare import check_sequence_pair as _check_pair
from tensoralg.prepare import check_slices as _check_slices
from tensoralg.prepare import position_selector
from tensoralg.request import make_request

# The node decomposition (forms, terms, one node per layer) is the package's own and unchanged
# since 942dfb0; the oracle re-checks the moment propagation built on it.
from tensoralg.strategies.closure import _closure_nodes, _lin_term, _Term, _upper
from tensoralg.strategies.wick.matchings import partial_matchings

_CLOSURE_PATHS: dict = {}


def _contract(expr: str, *ops):
    """``opt_einsum`` contraction with its expression (path) built once per (subscripts,
    shapes)."""
    key = (expr,) + tuple(o.shape for o in ops)
    fn = _CLOSURE_PATHS.get(key)
    if fn is None:
        fn = oe.contract_expression(expr, *(o.shape for o in ops), optimize="greedy")
        _CLOSURE_PATHS[key] = fn
    return fn(*ops)


def _unique(labels: str) -> str:
    return "".join(dict.fromkeys(labels))


def _isserlis_moment(t1: _Term, t2: _Term | None, mu1, mu2, C11, C12, C22):
    """``E[y1[t, o] y2[T, O]]`` (or ``E[y1[t, o]]`` when ``t2`` is None) with the layer input
    taken as jointly Gaussian: side 1 with mean ``mu1`` ``(n, d1)`` and covariance ``C11``
    ``(n, d1, n, d1)``, side 2 likewise, cross covariance ``C12`` ``(n, d1, n, d2)``. The
    lifted constant is exactly 1 at every position (a deterministic coordinate: mean 1,
    variance 0, so fully correlated across positions). Non-centred Isserlis: the sum over
    partial matchings of all the forms of both terms, pairs bridged by the covariance of the
    two forms, singletons by their mean (Isserlis 1918)."""
    forms = [(f.W, f.labels, 1) for f in t1.forms]
    cores = list(t1.cores)
    out = t1.out
    if t2 is not None:
        forms += [(f.W, _upper(f.labels), 2) for f in t2.forms]
        cores += [(a, _upper(lab)) for a, lab in t2.cores]
        out = t1.out + _upper(t2.out)
    mus = {1: mu1, 2: mu2}
    covs = {(1, 1): C11, (1, 2): C12, (2, 2): C22}
    means, pairs = {}, {}
    for i, (W, lab, side) in enumerate(forms):
        m = np.einsum(f"{lab}i,{lab[0]}i->{lab}", W[..., 1:], mus[side]) + W[..., 0]
        means[i] = (m, lab) if np.any(m != 0) else None
    for i in range(len(forms)):
        for j in range(i + 1, len(forms)):
            Wi, li, si = forms[i]
            Wj, lj, sj = forms[j]
            C = covs[(si, sj)]
            res = _unique(li + lj)
            c = _cov_same_pos(Wi, li, Wj, lj, C, res)
            pairs[(i, j)] = (c, res) if np.any(c != 0) else None
    total = None
    for match, singles in partial_matchings(len(forms)):
        ops, subs = [], []
        skip = False
        for i in singles:
            if means[i] is None:
                skip = True
                break
            ops.append(means[i][0])
            subs.append(means[i][1])
        if skip:
            continue
        for i, j in match:
            if pairs[(i, j)] is None:
                skip = True
                break
            ops.append(pairs[(i, j)][0])
            subs.append(pairs[(i, j)][1])
        if skip:
            continue
        for a, lab in cores:
            ops.append(a)
            subs.append(lab)
        val = _contract(",".join(subs) + "->" + out, *ops)
        total = val if total is None else total + val
    return total


def _cov_same_pos(Wi, li, Wj, lj, C, res):
    """``cov(form i, form j)`` over the labels ``res``; the two forms may read the same
    position label (then the covariance is taken at equal positions)."""
    if li[0] != lj[0]:
        return np.einsum(f"{li}i,{li[0]}i{lj[0]}j,{lj}j->{res}", Wi[..., 1:], C, Wj[..., 1:],
                         optimize=True)
    Cd = np.einsum("titj->tij", C)
    return np.einsum(f"{li}i,{li[0]}ij,{lj}j->{res}", Wi[..., 1:], Cd, Wj[..., 1:],
                     optimize=True)


def _term_dout(t: _Term) -> int:
    for arr, lab in t.cores:
        if "o" in lab:
            return arr.shape[lab.index("o")]
    return t.forms[0].W.shape[1]


def _node_moments(terms1, terms2, mu1, mu2, C11, C12, C22):
    """``E[y1[t, o] y2[T, O]]`` ``(n_ctx, d1, n_ctx, d2)`` of two nodes (sums of terms)."""
    n = mu1.shape[0]
    total = np.zeros((n, _term_dout(terms1[0]), n, _term_dout(terms2[0])))
    for x in terms1:
        for y in terms2:
            v = _isserlis_moment(x, y, mu1, mu2, C11, C12, C22)
            if v is not None:
                total = total + v
    return total


def _node_mean(terms, mu, C):
    """``E[y[t, o]]`` ``(n_ctx, d_out)`` of a node."""
    total = np.zeros((mu.shape[0], _term_dout(terms[0])))
    for x in terms:
        v = _isserlis_moment(x, None, mu, None, C, None, None)
        if v is not None:
            total = total + v
    return total


def _linear_W(terms):
    """The lifted ``(d_out, D_in + 1)`` matrix of an affine node, or None for a non-linear one."""
    if len(terms) == 1 and len(terms[0].forms) == 1 and not terms[0].cores:
        return terms[0].forms[0].W[0]
    return None


def _schedule(nodes):
    """``(stages, tail)``: each stage is (affine matrices before it, a non-linear node)."""
    stages, pending = [], []
    for terms, _ in nodes:
        W = _linear_W(terms)
        if W is None:
            stages.append((pending, terms))
            pending = []
        else:
            pending.append(W)
    return stages, pending


def _closure_state(a: Layer, b: Layer, n_ctx: int, need_self: bool = True):
    """Propagate ``(mu_a, mu_b, C_aa, C_ab, C_bb)`` through both models (see closure_inner).

    Affine nodes are applied on their own (exact for any distribution: moments of an affine
    map are affine in the moments); the k-th non-linear node of ``a`` and of ``b`` advance
    together, so at depth 1 both read the exactly Gaussian input. A model with fewer
    non-linear nodes keeps its activation (the identity) while the other advances. With
    ``need_self=False`` the self moments of the last stage are skipped (returned as None)."""
    d = a.in_features
    mu_a = mu_b = np.zeros((n_ctx, d))
    # the input: iid N(0, 1) entries; the lifted constant is kept apart (exactly 1)
    Caa = Cab = Cbb = np.eye(n_ctx)[:, None, :, None] * np.eye(d)[None, :, None, :]
    st_a, tail_a = _schedule(_closure_nodes(a, n_ctx, "a"))
    st_b, tail_b = _schedule(_closure_nodes(b, n_ctx, "b"))

    def affine(W, mu, Cxx, Cxy, side):
        mu2 = mu @ W[:, 1:].T + W[:, 0]
        Cxx2 = None if Cxx is None else np.einsum("oi,tiuj,pj->toup", W[:, 1:], Cxx, W[:, 1:])
        Cxy2 = np.einsum("oi,tiuj->touj", W[:, 1:], Cxy) if side == "a" else \
            np.einsum("tiuj,pj->tiup", Cxy, W[:, 1:])
        return mu2, Cxx2, Cxy2

    def ident(mu):
        d_ = mu.shape[1]
        return [_lin_term(np.concatenate([np.zeros((d_, 1)), np.eye(d_)], 1), n_ctx)]

    n_stages = max(len(st_a), len(st_b))
    for k in range(n_stages):
        last = k == n_stages - 1 and not need_self
        pre_a, ta_ = st_a[k] if k < len(st_a) else ([], None)
        pre_b, tb_ = st_b[k] if k < len(st_b) else ([], None)
        for W in pre_a:
            mu_a, Caa, Cab = affine(W, mu_a, Caa, Cab, "a")
        for W in pre_b:
            mu_b, Cbb, Cab = affine(W, mu_b, Cbb, Cab, "b")
        ta_ = ident(mu_a) if ta_ is None else ta_
        tb_ = ident(mu_b) if tb_ is None else tb_
        na_, nb_ = _node_mean(ta_, mu_a, Caa), _node_mean(tb_, mu_b, Cbb)
        Mab = _node_moments(ta_, tb_, mu_a, mu_b, Caa, Cab, Cbb)
        Cab = Mab - np.einsum("ti,uj->tiuj", na_, nb_)
        if last:
            Caa = Cbb = None
        else:
            Maa = _node_moments(ta_, ta_, mu_a, mu_a, Caa, Caa, Caa)
            Mbb = _node_moments(tb_, tb_, mu_b, mu_b, Cbb, Cbb, Cbb)
            Caa = Maa - np.einsum("ti,uj->tiuj", na_, na_)
            Cbb = Mbb - np.einsum("ti,uj->tiuj", nb_, nb_)
        mu_a, mu_b = na_, nb_
    for W in tail_a:
        mu_a, Caa, Cab = affine(W, mu_a, Caa, Cab, "a")
    for W in tail_b:
        mu_b, Cbb, Cab = affine(W, mu_b, Cbb, Cab, "b")
    return mu_a, mu_b, Caa, Cab, Cbb


def _closure_readout(mu1, mu2, C12, U, keep: bool, sel, each_t: bool):
    """``sum_t sel[t] sum_k (U f1[t]) (U f2[t])`` from the moments (arrays for 'each')."""
    E = np.einsum("titj->tij", C12) + np.einsum("ti,tj->tij", mu1, mu2)
    val = np.einsum("ko,top,kp->tk", U, E, U) * sel[:, None]
    if not each_t:
        val = val.sum(axis=0)
    if not keep:
        val = val.sum(axis=-1)
    return val


def _closure_output(output: Any, d_out: int):
    if output is None or isinstance(output, str):
        return np.eye(d_out), isinstance(output, str)
    if isinstance(output, numbers.Integral):
        return np.eye(d_out)[[int(output)]], False
    u = np.asarray(output.detach().cpu().double().numpy() if hasattr(output, "detach")
                   else output, dtype=np.float64)
    return u[None], False


def _closure_triple(a, b, n_ctx, output, position, need_self=True):
    a, b, n_ctx = _check_pair(a, b, n_ctx)
    _check_slices(make_request(output=output, position=position), a.out_features, n_ctx)
    a, b = a.astype_float(), b.astype_float()
    U, keep = _closure_output(output, a.out_features)
    sel = position_selector(n_ctx, position, False)
    each_t = isinstance(position, str)
    mu_a, mu_b, Caa, Cab, Cbb = _closure_state(a, b, n_ctx, need_self)
    ab = _closure_readout(mu_a, mu_b, Cab, U, keep, sel, each_t)
    if not need_self:
        return None, ab, None
    return (_closure_readout(mu_a, mu_a, Caa, U, keep, sel, each_t), ab,
            _closure_readout(mu_b, mu_b, Cbb, U, keep, sel, each_t))

