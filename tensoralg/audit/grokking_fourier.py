"""The Fourier picture of the grokking audit: power per frequency of the embedding and of the
bilinear layer over training, the key frequencies, and how tensor similarity's change tracks
the spectrum's change (next to the accuracy and a data baseline over all P² inputs).

The model reads ``onehot(a) ++ onehot(b)``: the embedding's ``(d_model, 2P)`` weight has one
column per token, and the bilinear layer, read through the embedding, has the ``(d_hidden,
2P)`` columns of ``left @ embed`` and ``right @ embed``. A modular-addition circuit built on
the characters ``exp(2 pi i k a / P)`` (Nanda et al. 2023, "Progress measures for grokking via
mechanistic interpretability") puts these columns' power on a few frequencies ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: The key frequencies: the fewest that carry at least this share of the final embedding's
#: non-constant power (largest first). Declared before any number.
KEY_POWER_SHARE = 0.8

#: How each quantity's change is compared with the spectrum's change (declared before any
#: number): Spearman rank correlation over the consecutive checkpoint intervals.
CORRELATION_RULE = (
    "over the consecutive checkpoint intervals i -> i+1: the spectrum's change is the total "
    "variation distance 0.5 * sum_k |p_i(k) - p_{i+1}(k)| between the embedding's normalised "
    "non-constant power spectra; it is compared by Spearman rank correlation with the tensor "
    "similarity's change 1 - S(i, i+1), the validation accuracy's change |acc_{i+1} - acc_i|, "
    "and the data baseline's change 1 - output cosine(i, i+1) over all P^2 inputs; the same "
    "against the final checkpoint (1 - S(i, final), spectrum distance to the final, ...) as "
    "a second reading")


def frequency_power(W: Any, P: int) -> np.ndarray:
    """Power per frequency ``k = 0 .. P // 2`` of weights ``W`` ``(rows, 2P)`` that read
    ``onehot(a) ++ onehot(b)``: ``sum_rows |DFT_k(W[:, :P])|^2 + |DFT_k(W[:, P:])|^2`` over
    the token axis, with ``k`` and ``P - k`` folded together (Parseval: the values sum to
    ``P * ||W||^2``).

    Raises:
        ValueError: ``W`` not ``(rows, 2P)``.
    """
    W = np.asarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[1] != 2 * P:
        raise ValueError(f"W: expected (rows, 2P) = (rows, {2 * P}), got {W.shape}")
    F = (np.abs(np.fft.rfft(W[:, :P], axis=1)) ** 2
         + np.abs(np.fft.rfft(W[:, P:], axis=1)) ** 2).sum(0)
    fold = np.full(F.shape, 2.0)
    fold[0] = 1.0
    if P % 2 == 0:
        fold[-1] = 1.0
    return F * fold


def model_spectra(model: Any, P: int) -> tuple[np.ndarray, np.ndarray]:
    """``(embedding power, bilinear-layer power)`` per frequency (`frequency_power`) of a
    grokking `tensoralg.nn.BilinearNet` (one block; the bilinear layer read through the
    embedding: ``left @ embed`` and ``right @ embed``)."""
    E = model.embed.weight.detach().double().numpy()
    blk = model.blocks[0]
    L = blk.left.weight.detach().double().numpy() @ E
    R = blk.right.weight.detach().double().numpy() @ E
    return frequency_power(E, P), frequency_power(L, P) + frequency_power(R, P)


def shares(power: np.ndarray) -> np.ndarray:
    """The non-constant part (``k >= 1``) of a power spectrum as fractions of its sum."""
    p = np.asarray(power, dtype=np.float64)[1:]
    total = p.sum()
    return p / total if total > 0 else np.full(p.shape, np.nan)


def key_frequencies(final_shares: Sequence[float]) -> list[int]:
    """The fewest frequencies (``k >= 1``, largest share first) whose shares of the final
    embedding's non-constant power sum to at least `KEY_POWER_SHARE`."""
    s = np.asarray(final_shares, dtype=np.float64)
    order = np.argsort(-s, kind="stable")
    n = int(np.searchsorted(np.cumsum(s[order]), KEY_POWER_SHARE - 1e-12) + 1)
    return sorted(int(k) + 1 for k in order[:n])


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return float(0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum())


def _spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or np.ptp(x[keep]) == 0 or np.ptp(y[keep]) == 0:
        return None
    return float(spearmanr(x[keep], y[keep]).statistic)


def fourier_record(models: Sequence[Any], P: int, sim: np.ndarray, val_acc: Sequence[float],
                   out_cos_neighbour: Sequence[float], out_cos_final: Sequence[float]) -> dict:
    """The Fourier picture over the checkpoints ``models``: the embedding's and the bilinear
    layer's shares of non-constant power per frequency ``k = 1 .. P // 2`` (lists per
    checkpoint), the constant (``k = 0``) share, the key frequencies (`key_frequencies`) and
    their share over training, and the correlations of `CORRELATION_RULE` (None where a
    quantity does not vary). ``sim``: the tensor similarity matrix (NaN: no reliable
    estimate, left out); ``out_cos_*``: the data baseline between neighbours / to the final."""
    emb, bil = zip(*(model_spectra(m, P) for m in models))
    p_emb = [shares(e) for e in emb]
    p_bil = [shares(b) for b in bil]
    key = key_frequencies(p_emb[-1])
    key_share = [float(p[np.array(key) - 1].sum()) for p in p_emb]
    key_share_bil = [float(p[np.array(key) - 1].sum()) for p in p_bil]
    n = len(models)
    spec_step = [total_variation(p_emb[i], p_emb[i + 1]) for i in range(n - 1)]
    spec_final = [total_variation(p, p_emb[-1]) for p in p_emb]
    sim = np.asarray(sim, dtype=float)
    tensor_step = [1 - sim[i, i + 1] for i in range(n - 1)]
    tensor_final = [1 - sim[i, -1] for i in range(n)]
    acc_step = [abs(val_acc[i + 1] - val_acc[i]) for i in range(n - 1)]
    acc_final = [abs(val_acc[-1] - v) for v in val_acc]
    data_step = [1 - v for v in out_cos_neighbour]
    data_final = [1 - v for v in out_cos_final]
    corr = {
        "intervals": {"tensor_similarity": _spearman(tensor_step, spec_step),
                      "val_accuracy": _spearman(acc_step, spec_step),
                      "data_output_cosine": _spearman(data_step, spec_step)},
        "to_final": {"tensor_similarity": _spearman(tensor_final[:-1], spec_final[:-1]),
                     "val_accuracy": _spearman(acc_final[:-1], spec_final[:-1]),
                     "data_output_cosine": _spearman(data_final[:-1], spec_final[:-1])},
    }
    return {
        "frequencies": list(range(1, P // 2 + 1)),
        "embedding_power_share": [p.tolist() for p in p_emb],
        "bilinear_power_share": [p.tolist() for p in p_bil],
        "embedding_constant_share": [float(e[0] / e.sum()) if e.sum() > 0 else None
                                     for e in emb],
        "key_frequencies": key,
        "key_rule": (f"the fewest frequencies k >= 1 (largest first) carrying >= "
                     f"{KEY_POWER_SHARE:.0%} of the final embedding's non-constant power"),
        "key_share_embedding": key_share,
        "key_share_bilinear": key_share_bil,
        "uniform_key_share": len(key) / (P // 2),
        "spectrum_change_intervals": spec_step,
        "spectrum_distance_to_final": spec_final,
        "correlation_rule": CORRELATION_RULE,
        "spearman": corr,
    }


def fourier_statement(rec: dict, steps: Sequence[int]) -> str:
    """One sentence: the key frequencies, their share at the start and the end, and the
    correlations."""
    def r(v):
        return "n/a (no variation)" if v is None else f"{v:+.2f}"

    c, f = rec["spearman"]["intervals"], rec["spearman"]["to_final"]
    key = rec["key_frequencies"]
    return (f"key frequencies {key} ({len(key)} of {len(rec['frequencies'])}; "
            f"{rec['key_rule']}): their share of the embedding's power goes from "
            f"{rec['key_share_embedding'][0]:.2f} at step {steps[0]} to "
            f"{rec['key_share_embedding'][-1]:.2f} at step {steps[-1]} (uniform spectrum: "
            f"{rec['uniform_key_share']:.2f}), of the bilinear layer's from "
            f"{rec['key_share_bilinear'][0]:.2f} to {rec['key_share_bilinear'][-1]:.2f}. "
            f"Spearman with the spectrum's change over the intervals: tensor similarity "
            f"{r(c['tensor_similarity'])}, validation accuracy {r(c['val_accuracy'])}, output "
            f"cosine over all P^2 inputs {r(c['data_output_cosine'])}; against the final "
            f"checkpoint: {r(f['tensor_similarity'])}, {r(f['val_accuracy'])}, "
            f"{r(f['data_output_cosine'])}")


def fourier_figure(path: Any, rec: dict, steps: Sequence[int], sim_to_final: Sequence[float],
                   out_cos_final: Sequence[float], val_acc: Sequence[float], title: str) -> Any:
    """Heatmaps frequency x checkpoint of the embedding's and the bilinear layer's power shares
    (key frequencies marked), and the spectrum's distance to the final checkpoint next to
    1 - tensor similarity to the final, 1 - output cosine to the final (all P^2 inputs) and the
    validation accuracy."""
    from .common import save_figure
    from .plotting import pyplot

    plt = pyplot()
    freqs = rec["frequencies"]
    fig, axes = plt.subplots(3, 1, figsize=(max(8.0, 0.32 * len(steps) + 3),
                                            0.22 * len(freqs) * 2 + 5.5),
                             layout="constrained",
                             gridspec_kw={"height_ratios": [len(freqs), len(freqs),
                                                            max(6, len(freqs) // 2)]})
    key = set(rec["key_frequencies"])
    im = None
    for ax, name, vals in ((axes[0], "embedding", rec["embedding_power_share"]),
                           (axes[1], "bilinear layer (left/right read through the embedding)",
                            rec["bilinear_power_share"])):
        v = np.asarray(vals, dtype=float).T
        im = ax.imshow(v, cmap="magma", aspect="auto", interpolation="nearest", vmin=0,
                       vmax=max(float(np.nanmax(v)), 1e-12))
        ax.set_yticks(range(len(freqs)))
        ax.set_yticklabels([f"{k} *" if k in key else str(k) for k in freqs],
                           fontsize=6 if len(freqs) > 30 else 7)
        ax.set_ylabel("frequency k (* key)")
        ax.set_xticks(range(len(steps)))
        ax.set_xticklabels([str(s) for s in steps], rotation=90, fontsize=6)
        ax.set_title(f"{name}: share of non-constant power per frequency", fontsize=9)
        fig.colorbar(im, ax=ax).set_label("share")
    ax = axes[2]
    x = np.arange(len(steps))
    ax.plot(x, rec["spectrum_distance_to_final"], "o-", ms=3, color="tab:purple",
            label="spectrum distance to final (total variation)")
    ax.plot(x, [1 - float(v) for v in sim_to_final], "s-", ms=3, color="tab:red",
            label="1 - tensor similarity to final")
    ax.plot(x, [1 - v for v in out_cos_final], "^-", ms=3, color="tab:blue",
            label="1 - output cosine to final (all P^2 inputs)")
    ax.plot(x, val_acc, color="tab:green", label="validation accuracy")
    ax.set_xticks(x)
    ax.set_xticklabels([str(s) for s in steps], rotation=90, fontsize=6)
    ax.set_xlabel("checkpoint (training step)")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside lower center", ncol=4)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
