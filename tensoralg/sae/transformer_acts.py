"""Real activations without downloads: the residual stream of a
[`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] on held-out text of the offline
corpus (`tensoralg.corpus`, Python's standard library source).

Layers. ``h_0 = W_E[tokens]`` is the embedded input, ``h_l`` the residual stream after block
``l`` (its attention and, when the model has one, its bilinear MLP), ``h_L`` (``L = n_layers``)
the final residual stream that the unembedding reads. ``layer=None`` means ``L``.

Rows. The held-out split of `tensoralg.corpus.load_corpus` (``n_chars`` characters of
selection) is cut into its first non-overlapping windows of ``n_ctx`` tokens
([`tensoralg.audit.language.eval_windows`][tensoralg.audit.language.eval_windows]), every position
of every window gives one row ``h_layer[window, t]`` (``(n_windows · n_ctx, d_model)``). The windows
are put in a fixed pseudo-random order (``numpy.random.default_rng(seed).permutation``) so that a
split by rows (``sae bench`` holds out the last rows) is a random split of windows rather than "the
modules late in the alphabet"; the rows of one window stay together, in position order. The
permutation is stored in the ``.json`` written next to the ``.npy``.

Model. Either a checkpoint folder (``weights.safetensors`` + ``cfg.json``, e.g. one of
``tensoralg audit language``'s ``checkpoints/step_*``), loaded by
[`tensoralg.checkpoint.load_checkpoint`][tensoralg.checkpoint.load_checkpoint] with its
forward-probe check, or, without one, a small model trained here by the language audit's own
training function
([`tensoralg.audit.language.train_language_model`][tensoralg.audit.language.train_language_model]:
AdamW on next-token cross-entropy, deterministic from ``seed`` on one thread; the defaults of
`QUICK_MODEL` take ~25 s on one core). The text is held out for a model trained here; for a
checkpoint, the held-out claim holds when its ``cfg.json`` records the same corpus
(``corpus_sha256``) as the selection used here, which the info dict reports as ``held_out``.
"""

from __future__ import annotations

import io as _io
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["QUICK_MODEL", "residual_stream_at", "resid_hook", "train_quick_transformer",
           "extract_transformer_activations", "check_layer", "load_transformer"]

# the model trained when no checkpoint is given (fields of audit.language.LanguageConfig):
# 2 blocks of bilinear attention + bilinear MLP, d_model 32, context 16; 600 AdamW steps
# reach a held-out loss of ~1.80 nats/char (unigram: ~3.3) in ~25 s on one core.
QUICK_MODEL = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, n_ctx=16,
                   rope=10000.0, steps=600, batch_size=64, lr=5e-3, grad_clip=1.0)
DEFAULT_CHARS = 200_000
WINDOW_BATCH_TOKENS = 16_384     # tokens per forward pass in the extraction


def resid_hook(layer: int, n_layers: int) -> tuple[str, str]:
    """The forward hook ``(hook_name, point)`` of `tensoralg.sae.hooks` at the residual
    stream ``h_layer`` of a [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer]: the
    output of its identity hook point ``hook_resid.{layer}`` (``0`` embedding ... ``n_layers``
    final)."""
    check_layer(layer, n_layers, "layer")
    return f"hook_resid.{layer}", "output"


def residual_stream_at(model, tokens, layer: int | None = None):
    """The residual stream ``h_layer`` ``(batch, T, d_model)`` of ``model`` on token ids
    ``tokens`` ``(batch, T)`` (module docstring: 0 = embedding, ``l`` = after block ``l``,
    ``None`` = ``n_layers`` = final). Computed by the model's own forward pass, read by
    `tensoralg.sae.hooks.activations_at` at
    [`resid_hook`][tensoralg.sae.transformer_acts.resid_hook] (the forward stops there), without
    gradients.

    Raises:
        ValueError: ``layer`` not an integer in ``[0, n_layers]``; bad tokens (the model's own
            check).
    """
    from .hooks import activations_at

    layer = check_layer(layer, model.hparams["n_layers"], "layer")
    name, point = resid_hook(layer, model.hparams["n_layers"])
    return activations_at(model, name, tokens, point=point).clone()


def check_layer(layer, n_layers: int, name: str) -> int:
    if layer is None:
        return n_layers
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
            not 0 <= layer <= n_layers:
        raise ValueError(f"{name}: expected an integer in [0, {n_layers}] (0 = embedding, "
                         f"{n_layers} = final residual stream of this {n_layers}-layer model), "
                         f"got {layer!r}")
    return int(layer)


def train_quick_transformer(train_tokens: np.ndarray, *, seed: int = 0, **overrides):
    """A small [`BilinearTransformer`][tensoralg.transformer.BilinearTransformer] trained on
    ``train_tokens`` by
    [`tensoralg.audit.language.train_language_model`][tensoralg.audit.language.train_language_model]
    with `QUICK_MODEL` (entries replaced by ``overrides``). Deterministic given ``seed`` and the
    thread count.

    Returns:
        ``(model, info)``: the float32 model and ``{"config": ..., "final_train_loss": ...}``.

    Raises:
        ValueError: an unknown override or an invalid configuration (the language audit's checks).
    """
    from dataclasses import asdict, fields

    from ..audit.language import LanguageConfig, make_model, train_language_model
    from ..corpus import VOCAB

    known = {f.name for f in fields(LanguageConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"overrides: unknown model/training settings {sorted(unknown)}; expected "
                         f"some of {sorted(QUICK_MODEL)}")
    cfg = LanguageConfig(**{**QUICK_MODEL, **overrides, "seed": seed, "checkpoints": 2,
                            "eval_windows": 1, "mc_pairs": 0})
    cfg.validate()
    model = make_model(cfg, len(VOCAB))
    hist = train_language_model(model, train_tokens, cfg, [cfg.steps], lambda step, m: None)
    keys = list(QUICK_MODEL) + ["seed"]
    info = {"config": {k: v for k, v in asdict(cfg).items() if k in keys},
            "final_train_loss": hist["loss"][-1]}
    return model.eval(), info


def extract_transformer_activations(out, checkpoint=None, layer: int | None = None, *,
                                    n_chars: int = DEFAULT_CHARS, n_windows: int | None = None,
                                    seed: int = 0, train: dict | None = None,
                                    save_checkpoint_to=None, dtype: str = "float32") -> dict:
    """Write the residual stream of a bilinear transformer on held-out corpus text to ``out``
    (``.npy``, ``(n_windows · n_ctx, d_model)``) and its description to ``out + ".json"``, both
    atomically (module docstring for the layers, rows and model).

    Args:
        out: output ``.npy`` path.
        checkpoint: a transformer checkpoint folder; ``None``: train one here (`QUICK_MODEL`
            updated by ``train``, seeded with ``seed``).
        layer: ``0..n_layers``; ``None``: the final residual stream.
        n_chars: corpus selection size (`tensoralg.corpus.load_corpus`); the held-out
            split is ~10 % of it.
        n_windows: number of held-out windows of ``n_ctx`` tokens (default: all of them).
        seed: the window order and, without a checkpoint, the model's initialization and batches.
        save_checkpoint_to: where to save the model trained here (optional; refused with a
            checkpoint given).
        dtype: ``"float32"`` (default) or ``"float64"``; computed in float64 either way.

    Returns:
        the info dict (also written as JSON).

    Raises:
        FileNotFoundError: ``checkpoint`` is not a folder or lacks its files.
        ValueError: a corrupt checkpoint or one that is not a bilinear transformer, ``layer``
            out of range, too many windows, other bad arguments — all before the corpus is read
            or anything trained.
    """
    import torch

    from ..audit.common import check_file_writable
    from ..audit.language import eval_windows
    from ..corpus import load_corpus
    from ..io import atomic_write_bytes, atomic_write_json

    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype: expected 'float32' or 'float64', got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
    if n_windows is not None and (isinstance(n_windows, bool) or not isinstance(n_windows, int)
                                  or n_windows < 1):
        raise ValueError(f"n_windows: expected a positive integer or None (all), got "
                         f"{n_windows!r}")
    if Path(out).suffix != ".npy" or Path(out).is_dir():
        raise ValueError(f"out: expected a .npy file path (sae train/bench read .npy), got {out}")
    check_file_writable(out, "out")
    ckpt_cfg = None
    if checkpoint is not None:
        if train:
            raise ValueError(f"train: settings for training a model ({sorted(train)}) were given "
                             f"together with checkpoint={checkpoint}; give one or the other")
        if save_checkpoint_to is not None:
            raise ValueError("save_checkpoint_to: only a model trained here can be saved; "
                             f"checkpoint={checkpoint} is already on disk")
        model, ckpt_cfg = load_transformer(checkpoint, layer)
        layer = check_layer(layer, model.hparams["n_layers"], "layer")
    else:
        from dataclasses import fields

        from ..audit.language import LanguageConfig
        known = {f.name for f in fields(LanguageConfig)} - {"seed"}
        bad = set(train or {}) - known
        if bad:
            raise ValueError(f"train: unknown settings {sorted(bad)}; expected some of "
                             f"{sorted(QUICK_MODEL)}")
        try:    # the language audit's own checks of the sizes, before any work
            LanguageConfig(**{**QUICK_MODEL, **(train or {}), "seed": seed, "checkpoints": 2,
                              "eval_windows": 1, "mc_pairs": 0}).validate()
        except ValueError as exc:
            raise ValueError(f"train: {exc}") from None
        n_layers = (train or {}).get("n_layers", QUICK_MODEL["n_layers"])
        layer = check_layer(layer, n_layers, "layer")
        if save_checkpoint_to is not None:
            from ..audit.common import check_folder_path
            check_folder_path(Path(save_checkpoint_to), "save_checkpoint_to")
            if Path(save_checkpoint_to).exists():
                raise ValueError(f"save_checkpoint_to: {save_checkpoint_to} exists; give a new "
                                 f"path")
    corpus = load_corpus(n_chars)
    n_ctx = (model.hparams["n_ctx"] if checkpoint is not None
             else (train or {}).get("n_ctx", QUICK_MODEL["n_ctx"]))
    available = len(corpus.held_out) // n_ctx
    count = available if n_windows is None else n_windows
    if count > available:        # checked before a model is trained here
        raise ValueError(f"n_windows: {count} windows of n_ctx={n_ctx} tokens requested, the "
                         f"held-out text of n_chars={n_chars} has {available}")
    info: dict[str, Any] = {"source": "bilinear transformer residual stream",
                            "corpus": {k: corpus.provenance[k] for k in (
                                "source", "python_version", "n_chars_requested", "n_chars",
                                "split", "sha256_text", "n_held_out_tokens")}}
    if checkpoint is None:
        model, tinfo = train_quick_transformer(corpus.train, seed=seed, **(train or {}))
        info["model"] = {"trained_here": True, **tinfo, "architecture": model.config()}
        info["held_out"] = "yes: the model was trained on the train split of this selection"
        if save_checkpoint_to is not None:
            from ..checkpoint import save_checkpoint
            save_checkpoint(save_checkpoint_to, model, step=tinfo["config"]["steps"], provenance={
                "data": "python stdlib source (tensoralg.corpus)",
                "corpus_sha256": corpus.provenance["sha256_text"], "corpus_n_chars": n_chars,
                "python_version": corpus.provenance["python_version"],
                "run": "sae activations --source transformer"})
            info["model"]["saved_to"] = str(save_checkpoint_to)
    else:
        info["model"] = {"trained_here": False, "checkpoint": str(checkpoint),
                         "architecture": model.config(), "step": ckpt_cfg.get("step")}
        want = ckpt_cfg.get("corpus_sha256")
        if want is None:
            info["held_out"] = ("unknown: the checkpoint does not record its corpus "
                                "(corpus_sha256)")
        elif want == corpus.provenance["sha256_text"]:
            info["held_out"] = "yes: the checkpoint's corpus_sha256 equals this selection's"
        else:
            info["held_out"] = (f"not verified: the checkpoint was trained on another selection "
                                f"(corpus_sha256 {want[:12]}..., here "
                                f"{corpus.provenance['sha256_text'][:12]}...); use the run's "
                                f"n_chars (language.json: config.n_chars) to make the text "
                                f"held out")
    assert model.hparams["n_ctx"] == n_ctx
    W = eval_windows(corpus.held_out, n_ctx, count)
    order = np.random.default_rng(seed).permutation(count)
    W = torch.as_tensor(W[order])
    m64 = model.double().eval()
    # batches of windows bound the (batch, heads, n_ctx, n_ctx) attention patterns' memory
    per = max(1, WINDOW_BATCH_TOKENS // n_ctx)
    acts = np.concatenate([residual_stream_at(m64, W[i:i + per], layer).reshape(
        -1, m64.hparams["d_model"]).numpy() for i in range(0, count, per)]).astype(dtype)
    if not np.isfinite(acts).all():
        raise ValueError(f"checkpoint: the residual stream has non-finite entries at layer "
                         f"{layer}")
    buf = _io.BytesIO()
    np.save(buf, acts, allow_pickle=False)
    info.update({"layer": layer, "n_layers": model.hparams["n_layers"],
                 "layer_meaning": ("embedding h_0" if layer == 0 else
                                   "final residual stream (input of the unembedding)"
                                   if layer == model.hparams["n_layers"] else
                                   f"residual stream after block {layer}"),
                 "shape": list(acts.shape), "dtype": dtype, "n_windows": count, "n_ctx": n_ctx,
                 "rows": "window-major: row i * n_ctx + t is position t of window order[i]",
                 "window_order_seed": seed, "window_order": order.tolist(), "out": str(out)})
    hook = resid_hook(layer, model.hparams["n_layers"])
    # what an SAE trained on these rows records in cfg.json "metadata" (as SAELens)
    info["metadata"] = {
        "model_name": (str(checkpoint) if checkpoint is not None else
                       "tensoralg BilinearTransformer trained here (sae activations)"),
        "model_class_name": "BilinearTransformer",
        "hook_name": hook[0], "hook_point": hook[1],
        "dataset_path": f"tensoralg.corpus held-out split (sha256 "
                        f"{corpus.provenance['sha256_text'][:16]}...)",
        "context_size": n_ctx}
    atomic_write_bytes(out, buf.getvalue())
    atomic_write_json(str(out) + ".json", info)
    return info


def load_transformer(checkpoint, layer=None):
    """``(model, cfg)`` of a transformer checkpoint folder, with errors naming ``checkpoint``;
    ``layer`` is checked against cfg.json's ``n_layers`` before the weights are read."""
    from ..checkpoint import load_checkpoint, read_checkpoint_config
    from ..transformer import ARCHITECTURE

    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint: {checkpoint} is not a folder (expected a "
                                f"transformer checkpoint: weights.safetensors + cfg.json)")
    try:
        cfg = read_checkpoint_config(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"checkpoint: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"checkpoint: {exc}") from None
    if cfg.get("architecture") != ARCHITECTURE:
        raise ValueError(f"checkpoint: {checkpoint} holds architecture "
                         f"{cfg.get('architecture')!r}, expected {ARCHITECTURE!r} (a "
                         f"tensoralg BilinearTransformer checkpoint)")
    if isinstance(cfg.get("n_layers"), int) and not isinstance(cfg["n_layers"], bool):
        check_layer(layer, cfg["n_layers"], "layer")
    try:
        model, cfg = load_checkpoint(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"checkpoint: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"checkpoint: {exc}") from None
    return model.eval(), cfg
