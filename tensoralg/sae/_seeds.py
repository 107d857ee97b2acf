"""Independent random streams from one user seed.

Every random draw in [`tensoralg.sae`][tensoralg.sae] goes through a private ``torch.Generator``
seeded by `stream_seed`, which mixes the user's seed with a *stream name* (``"data"``, ``"init"``,
``"batches"``, ``"b_dec"``, ``"resample"``, ``"resample_pool"``, ``"stream_sequences"``,
``"stream_shuffle"``) through
`numpy.random.SeedSequence` (its hash-based entropy mixing, O'Neill's PCG seeding scheme).
Two streams with the same user seed are therefore unrelated: ``make_synthetic(seed=s)`` and
``SparseAutoencoder(cfg, seed=s)`` no longer draw the same Gaussian matrix (which made an untrained
SAE *be* the ground-truth dictionary).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["STREAMS", "stream_seed", "stream_generator"]

# fixed salts, one per stream (ASCII of the name); never reuse one for another purpose
STREAMS = {name: int.from_bytes(name.encode(), "big")
           for name in ("data", "init", "batches", "b_dec", "resample", "resample_pool",
                         "stream_sequences", "stream_shuffle")}


def stream_seed(seed: int, stream: str, *extra: int) -> int:
    """A 63-bit seed for ``stream`` derived from the user ``seed`` (and ``extra`` ints, e.g. an epoch).

    Raises:
        ValueError: ``seed`` / ``extra`` not ints >= 0, or an unknown ``stream``.
    """
    if stream not in STREAMS:
        raise ValueError(f"stream: expected one of {sorted(STREAMS)}, got {stream!r}")
    for v in (seed, *extra):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"seed: expected an int >= 0, got {v!r}")
    ss = np.random.SeedSequence([int(seed), STREAMS[stream], *map(int, extra)])
    return int(ss.generate_state(1, np.uint64)[0]) >> 1


def stream_generator(seed: int, stream: str, *extra: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with `stream_seed`."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, *extra))
