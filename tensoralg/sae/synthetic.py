"""Synthetic activations with a ground-truth sparse decomposition.

``x = z @ D + noise`` with a unit-norm overcomplete dictionary ``D`` (``m`` atoms in ``d``
dimensions, rows of a ``(m, d)`` matrix, i.i.d. Gaussian directions) and ``k``-sparse codes ``z``
whose supports are uniform random ``k``-subsets and whose non-zero coefficients have magnitude
uniform in ``[min_abs, max_abs]`` (bounded away from 0) and a random sign (or all positive).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._seeds import stream_generator

__all__ = ["SyntheticData", "make_synthetic", "random_dictionary"]


@dataclass
class SyntheticData:
    """``x (n, d)``, ground-truth dictionary ``W_dec (m, d)`` (unit rows), codes ``z (n, m)``."""

    x: torch.Tensor
    W_dec: torch.Tensor
    z: torch.Tensor
    noise: float
    seed: int

    @property
    def supports(self) -> torch.Tensor:
        """``(n, k)`` sorted latent indices of the non-zeros of each code."""
        k = int((self.z[0] != 0).sum())
        return torch.nonzero(self.z != 0)[:, 1].reshape(-1, k)


def random_dictionary(m: int, d: int, generator: torch.Generator | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(m, d)`` matrix of i.i.d. uniformly random unit vectors (normalized Gaussians)."""
    D = torch.randn(m, d, generator=generator, dtype=torch.float64)
    return (D / D.norm(dim=1, keepdim=True)).to(dtype)


def make_synthetic(n: int, d: int, m: int, k: int, *, noise: float = 0.0, min_abs: float = 0.5,
                   max_abs: float = 1.5, signed: bool = True, seed: int = 0,
                   dictionary: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> SyntheticData:
    """Draw ``n`` samples ``x = z @ D + noise * ε`` with ``ε ~ N(0, I_d / d)``.

    Args:
        n, d, m, k: samples, dimension, atoms, non-zeros per code (``1 <= k <= m``).
        noise: noise standard deviation per sample norm (``E‖noise‖² = noise²``).
        min_abs, max_abs: coefficient magnitudes are uniform in ``[min_abs, max_abs]``,
            ``0 < min_abs <= max_abs``.
        signed: random ±1 signs (``True``) or all-positive coefficients.
        seed: an int >= 0 seeding a private ``torch.Generator`` through the ``"data"`` stream of
            `tensoralg.sae._seeds.stream_seed` (the global RNG is untouched). The stream is
            independent of an SAE's ``"init"`` stream, so an SAE seeded with the same number
            does not start at the ground-truth dictionary.
        dictionary: reuse this ``(m, d)`` dictionary (e.g. a held-out set from the same
            ground truth); normalized to unit rows.
    Raises:
        ValueError: non-positive sizes, ``k > m``, bad magnitudes, a negative seed or a wrong
            dictionary shape.
    """
    for name, v in (("n", n), ("d", d), ("m", m), ("k", k)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if k > m:
        raise ValueError(f"k: expected k <= m={m}, got {k}")
    if not (0 < min_abs <= max_abs) or max_abs == float("inf"):
        raise ValueError(f"min_abs, max_abs: expected 0 < min_abs <= max_abs < inf, got "
                         f"{min_abs}, {max_abs}")
    if not (noise >= 0) or noise == float("inf"):
        raise ValueError(f"noise: expected a finite number >= 0, got {noise}")
    gen = stream_generator(seed, "data")
    if dictionary is None:
        D = random_dictionary(m, d, gen, torch.float64)
    else:
        D = torch.as_tensor(dictionary).detach().to("cpu", torch.float64)
        if D.shape != (m, d):
            raise ValueError(f"dictionary: expected shape (m={m}, d={d}), got {tuple(D.shape)}")
        D = D / D.norm(dim=1, keepdim=True).clamp_min(1e-12)
    supports = torch.argsort(torch.rand(n, m, generator=gen), dim=1)[:, :k]
    mags = min_abs + (max_abs - min_abs) * torch.rand(n, k, generator=gen, dtype=torch.float64)
    if signed:
        mags = mags * (2.0 * torch.randint(0, 2, (n, k), generator=gen) - 1.0)
    z = torch.zeros(n, m, dtype=torch.float64).scatter(1, supports, mags)
    x = z @ D
    if noise > 0:
        x = x + noise * torch.randn(n, d, generator=gen, dtype=torch.float64) / d ** 0.5
    return SyntheticData(x=x.to(dtype), W_dec=D.to(dtype), z=z.to(dtype), noise=float(noise),
                         seed=int(seed))
