"""Downstream evaluation of an SAE: splice its reconstruction into the model at its hook and
measure what the model loses ("CE loss recovered"), on held-out text.

For a language model ``f`` and an SAE at hook ``h`` (`tensoralg.sae.hooks`), over the
next-token predictions of the evaluation batches:

* ``loss_clean`` — mean next-token cross-entropy (nats) of the model as it is;
* ``loss_spliced`` — the same with the activation at ``h`` replaced by the SAE's
  reconstruction ``x̂ = SAE(x)`` (its ``forward``: encode, decode, in the input's space);
* ``loss_zero`` — the same with the activation replaced by zeros (zero ablation);
* ``ce_loss_recovered = (loss_zero - loss_spliced) / (loss_zero - loss_clean)`` — 1 when the
  splice costs nothing, 0 when it is as bad as removing the activation (the "fraction of loss
  recovered" of Bricken et al., "Towards Monosemanticity", 2023, and of SAELens's
  ``evals.py`` / SAEBench; ``None`` when ``loss_zero == loss_clean``);
* ``kl_spliced`` / ``kl_zero`` — mean over predicted tokens of ``KL(p_clean ‖ p_spliced)``
  (``KL(p_clean ‖ p_zero)``) in nats, ``p`` the next-token distributions (softmax of the logits);
* ``fvu`` — fraction of variance unexplained of the SAE on the activations it saw there
  (``Σ‖x - x̂‖² / Σ‖x - mean(x)‖²``; ``None``, undefined, when all those rows are equal:
  zero variance), ``l0`` — mean active latents per row;
* ``l2_ratio`` — mean over rows of ``‖x̂‖ / ‖x‖`` (rows with ``x = 0`` left out; ``None`` when
  all are zero): below 1 when the SAE shrinks its reconstructions;
* ``relative_reconstruction_bias`` — ``Σ‖x̂‖² / Σ x·x̂`` over all rows, the ``g`` minimizing
  ``Σ‖x̂/g - x‖²`` (Rajamanoharan et al., "Improving Dictionary Learning with Gated Sparse
  Autoencoders", 2024, eq. 10; as SAEBench's ``relative_reconstruction_bias``, but over all rows
  at once rather than a mean of per-batch ratios): 1 without shrinkage, below 1 with it
  (``None`` when ``Σ x·x̂ = 0``).

Every quantity is a plain average over predicted tokens of exact per-token values (no
sampling); ``tests/test_sae_evaluation.py`` checks them against a forward pass written out
by hand and the cross-entropy / KL written in numpy, to 1e-12 in float64.

`evaluate_spliced` takes any ``torch.nn.Module`` whose output is the logits
``(batch, T, vocab)`` (or has a ``.logits`` attribute, as Hugging Face models) and a hook;
`evaluate_transformer` does it for a
[`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] at the residual stream of layer
``l`` (``--layer`` of ``sae activations``) on the held-out windows of the offline corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .hooks import call_model, get_submodule, spliced

__all__ = ["evaluate_spliced", "evaluate_transformer", "next_token_logits", "fixed_support_map",
           "spliced_network"]


def next_token_logits(output, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (N, V), targets (N,))`` of next-token prediction: position ``t`` of each row
    of the token batch ``(B, T)`` predicts token ``t + 1`` (``N = B (T - 1)``). ``output`` is
    the logits ``(B, T, V)`` or an object with ``.logits``; a batch given as a tuple or dict
    takes its first element / ``input_ids`` as the tokens.

    Raises:
        ValueError: the logits are not ``(B, T, V)`` for tokens ``(B, T)``, or ``T < 2``.
    """
    logits = getattr(output, "logits", output)
    tokens = batch
    if isinstance(batch, dict):
        tokens = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)):
        tokens = batch[0]
    if not isinstance(logits, torch.Tensor) or not isinstance(tokens, torch.Tensor) or \
            logits.ndim != 3 or tokens.ndim != 2 or logits.shape[:2] != tokens.shape or \
            tokens.shape[1] < 2:
        raise ValueError(f"next_token_logits: expected logits (B, T, V) for tokens (B, T >= 2), "
                         f"got {tuple(getattr(logits, 'shape', ()))} and "
                         f"{tuple(getattr(tokens, 'shape', ()))}")
    return (logits[:, :-1].reshape(-1, logits.shape[-1]),
            tokens[:, 1:].reshape(-1).to(torch.int64))


class _Sums:
    def __init__(self):
        self.v: dict[str, float] = {}
        # the first activation row, and whether any row differs from it: zero variance (all
        # rows equal) is decided exactly, not by the sign of x2 - n mean^2 (cancellation)
        self.first: torch.Tensor | None = None
        self.varies = False

    def add(self, key: str, value) -> None:
        self.v[key] = self.v.get(key, 0.0) + float(value)


def _sae_fn(sae, sums: _Sums, d_in: int, hook: str) -> Callable[[torch.Tensor], torch.Tensor]:
    dtype = sae.W_dec.dtype

    def fn(act: torch.Tensor) -> torch.Tensor:
        if act.shape[-1] != d_in:
            name = sae.describe() if hasattr(sae, "describe") else type(sae).__name__
            raise ValueError(f"sae: d_in={d_in} ({name}), but the activation at "
                             f"{hook!r} has shape {tuple(act.shape)}")
        x = act.reshape(-1, d_in).to(dtype)
        with torch.no_grad():
            z = sae.encode(x)
            x_hat = sae(x)
        x64, e64 = x.double(), (x - x_hat).double()
        if sums.first is None:
            sums.first = x64[:1].clone()
        if not sums.varies:
            sums.varies = bool((x64 != sums.first).any())
        sums.add("rows", x.shape[0])
        sums.add("err2", (e64 ** 2).sum())
        sums.add("x2", (x64 ** 2).sum())
        for j, s in enumerate(x64.sum(dim=0).tolist()):
            sums.add(f"x1_{j}", s)
        sums.add("l0", (z != 0).sum())
        h64 = x_hat.double()
        nx = x64.norm(dim=1)
        nz = nx > 0
        sums.add("l2_ratio", (h64.norm(dim=1)[nz] / nx[nz]).sum())
        sums.add("l2_rows", nz.sum())
        sums.add("xhat2", (h64 ** 2).sum())
        sums.add("x_xhat", (x64 * h64).sum())
        return x_hat.to(act.dtype).reshape(act.shape)
    return fn


def _ce_kl(clean: torch.Tensor, other: torch.Tensor, targets: torch.Tensor):
    """Sums over tokens of the cross-entropy of ``other`` and of ``KL(p_clean ‖ p_other)``,
    in float64."""
    lc = F.log_softmax(clean.double(), dim=-1)
    lo = F.log_softmax(other.double(), dim=-1)
    ce = F.nll_loss(lo, targets, reduction="sum")
    kl = (lc.exp() * (lc - lo)).sum()
    return ce, kl


def evaluate_spliced(model: nn.Module, sae, hook_name: str, batches: Iterable, *,
                     point: str = "output",
                     logits_fn: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor]] =
                     next_token_logits, progress: bool = False) -> dict:
    """Splice ``sae``'s reconstruction into ``model`` at ``(hook_name, point)`` and report the
    downstream metrics of the module docstring over ``batches`` (model inputs, e.g. token
    tensors ``(B, T)`` of held-out text).

    Args:
        model: any ``torch.nn.Module`` (evaluated under ``torch.no_grad``; put it in eval mode
            first if it has dropout).
        sae: a [`SparseAutoencoder`][tensoralg.sae.models.SparseAutoencoder] whose ``d_in`` is the
            last dimension of the activation at the hook (its rows are the positions).
        logits_fn: ``(output, batch) -> (logits (N, V), targets (N,))``; default
            `next_token_logits`.
    Returns:
        dict with ``loss_clean``, ``loss_spliced``, ``loss_zero``, ``ce_loss_recovered``,
        ``kl_spliced``, ``kl_zero`` (nats per predicted token), ``fvu``, ``l0``, ``l2_ratio``,
        ``relative_reconstruction_bias``, ``n_tokens``,
        ``n_rows``, ``hook_name``, ``point``.
    Raises:
        ValueError: an unknown ``hook_name`` (nearest names listed) or ``point``, before any
            forward pass; an SAE whose ``d_in`` is not the activation's width, or NaN/inf in
            the activation (at the first batch, before any result); no batches.
    """
    from tqdm.auto import tqdm

    from .hooks import check_point

    check_point(point)
    get_submodule(model, hook_name)
    d_in = sae.cfg.d_in
    sums = _Sums()
    fn = _sae_fn(sae, sums, d_in, hook_name)

    def finite(act):
        if not bool(torch.isfinite(act).all()):
            raise ValueError(f"the activation at {hook_name!r} has NaN or inf")
        return act

    was_training = sae.training
    sae.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(batches, desc=f"splice at {hook_name}", unit="batch",
                              disable=None if progress else True):
                with spliced(model, hook_name, finite, point):
                    clean, targets = logits_fn(call_model(model, batch), batch)
                with spliced(model, hook_name, fn, point):
                    spl, _ = logits_fn(call_model(model, batch), batch)
                with spliced(model, hook_name, torch.zeros_like, point):
                    zero, _ = logits_fn(call_model(model, batch), batch)
                sums.add("ce_clean", F.cross_entropy(clean.double(), targets, reduction="sum"))
                ce, kl = _ce_kl(clean, spl, targets)
                sums.add("ce_spliced", ce)
                sums.add("kl_spliced", kl)
                ce, kl = _ce_kl(clean, zero, targets)
                sums.add("ce_zero", ce)
                sums.add("kl_zero", kl)
                sums.add("tokens", targets.numel())
    finally:
        sae.train(was_training)
    v = sums.v
    if not v.get("tokens"):
        raise ValueError("batches: no predicted tokens (no batches, or sequences of length 1)")
    n = v["tokens"]
    rows = v["rows"] / 1.0
    mean_sq = sum(v[f"x1_{j}"] ** 2 for j in range(d_in)) / rows
    var = v["x2"] - mean_sq
    lc, ls, lz = v["ce_clean"] / n, v["ce_spliced"] / n, v["ce_zero"] / n
    return {"hook_name": hook_name, "point": point, "loss_clean": lc, "loss_spliced": ls,
            "loss_zero": lz,
            "ce_loss_recovered": (lz - ls) / (lz - lc) if lz != lc else None,
            "kl_spliced": v["kl_spliced"] / n, "kl_zero": v["kl_zero"] / n,
            "fvu": v["err2"] / var if sums.varies and var > 0 else None, "l0": v["l0"] / rows,
            "l2_ratio": v["l2_ratio"] / v["l2_rows"] if v["l2_rows"] else None,
            "relative_reconstruction_bias": v["xhat2"] / v["x_xhat"] if v["x_xhat"] else None,
            "n_tokens": int(n), "n_rows": int(rows)}


def evaluate_transformer(model, sae, layer: int | None, tokens: torch.Tensor,
                         batch_size: int = 64, progress: bool = False) -> dict:
    """`evaluate_spliced` for a [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer]
    with the SAE at the residual stream ``h_layer`` (``0`` embedding, ``l`` after block ``l``,
    ``None``/``n_layers`` final: the hook point ``hook_resid.{layer}``), on token windows
    ``tokens (n, T)`` (e.g.
    [`tensoralg.audit.language.eval_windows`][tensoralg.audit.language.eval_windows] of the corpus's
    held-out split), in batches of ``batch_size`` windows.

    Raises:
        ValueError: ``layer`` out of range; ``tokens`` not ``(n, T >= 2)``; see
            `evaluate_spliced`.
    """
    from .transformer_acts import check_layer, resid_hook

    n_layers = model.hparams["n_layers"]
    layer = check_layer(layer, n_layers, "layer")
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens: expected (n_windows, T >= 2), got {tuple(tokens.shape)}")
    batches = [tokens[i:i + batch_size] for i in range(0, tokens.shape[0], batch_size)]
    name, point = resid_hook(layer, n_layers)
    out = evaluate_spliced(model, sae, name, batches, point=point, progress=progress)
    out["layer"] = layer
    return out


def fixed_support_map(sae, support) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map ``x ↦ x A + c`` (row convention, ``A (d_in, d_in)``, ``c (d_in,)``, float64)
    that a single-step SAE computes on every input whose code has support ``support`` (for TopK
    / ReLU / JumpReLU also: positive there and, for JumpReLU, above the threshold):
    ``x̂ = ((x - b_dec) W_enc[:, S] + b_enc[S]) W_dec[S] + b_dec``, so
    ``A = W_enc[:, S] W_dec[S]``, ``c = (b_enc[S] - b_dec W_enc[:, S]) W_dec[S] + b_dec``.

    Raises:
        ValueError: a multi-step encoder or ``layer_norm`` normalization (not affine on a
            support); ``support`` not distinct latent indices in ``[0, d_sae)``.
    """
    cfg = sae.cfg
    if cfg.encoder != "single" or cfg.normalize_activations != "none":
        raise ValueError(f"sae: the fixed-support map is affine only for a single-step encoder "
                         f"without normalization, got encoder={cfg.encoder!r}, "
                         f"normalize_activations={cfg.normalize_activations!r}")
    S = torch.as_tensor(support, dtype=torch.int64).reshape(-1)
    if S.numel() == 0 or int(S.min()) < 0 or int(S.max()) >= cfg.d_sae or \
            S.unique().numel() != S.numel():
        raise ValueError(f"support: expected distinct latent indices in [0, {cfg.d_sae}), got "
                         f"{S.tolist()}")
    W_enc, W_dec = sae.W_enc.detach().double()[:, S], sae.W_dec.detach().double()[S]
    b_enc, b_dec = sae.b_enc.detach().double()[S], sae.b_dec.detach().double()
    return W_enc @ W_dec, (b_enc - b_dec @ W_enc) @ W_dec + b_dec


def spliced_network(model, sae, layer: int | None, support):
    """The exact tensoralg network (`BilinearTransformer.to_network`: residual stream
    ``h_0`` -> logits) of ``model`` with the residual stream ``h_layer`` replaced by the SAE's
    reconstruction on the fixed support ``support`` (`fixed_support_map`, a ``Linear``
    layer with bias inserted before block ``layer``, or before the unembedding for the final
    stream). Its Gaussian similarity to ``model.to_network()`` is then
    ``tensoralg.similarity(model.to_network(), spliced_network(...))``: computed exactly where
    the project's exact sequence inner product applies (one bilinear-attention layer between
    per-position linear layers: a one-block attention-only model), otherwise refused with
    ``CostTooHigh`` naming the approximate methods (``method="closure"``/``"montecarlo"``).

    Raises:
        ValueError: ``layer`` out of range; see `fixed_support_map`; an SAE whose
            ``d_in`` is not ``d_model``.
    """
    from ..layers import Linear, Sequential
    from .transformer_acts import check_layer

    n_layers = model.hparams["n_layers"]
    layer = check_layer(layer, n_layers, "layer")
    if sae.cfg.d_in != model.hparams["d_model"]:
        raise ValueError(f"sae: d_in={sae.cfg.d_in}, the model's residual stream has d_model="
                         f"{model.hparams['d_model']}")
    A, c = fixed_support_map(sae, support)
    net = model.to_network()
    per_block = 1 if model.mlp is None else 2
    layers = list(net.layers)
    layers.insert(layer * per_block, Linear(A.T.numpy(), c.numpy()))
    return Sequential(layers)
