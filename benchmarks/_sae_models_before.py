"""tensoralg/sae/models.py as of commit 15ea9a9 (before the top-k speed-up), kept verbatim as the
"before" arm of ``bench_sae.py --speed``; only this docstring and the relative import are
changed. Not part of the package."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from tensoralg.sae._seeds import stream_generator

__all__ = ["SAEConfig", "SparseAutoencoder", "select_topk", "topk", "abstopk", "rip_penalty",
           "rip_constants", "geometric_median"]

_ACTIVATIONS = ("topk", "abstopk")
_ENCODERS = ("single", "multistep")
_GAMMAS = ("free", "diag", "tied")
_RIPS = ("none", "eig", "fro")
_B_DEC_INITS = ("mean", "geometric_median", "zeros")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


@dataclass
class SAEConfig:
    """Architecture of a sparse autoencoder (all fields are saved flat in ``cfg.json``).

    Attributes:
        d_in: activation dimension ``d``.
        d_sae: number of latents / dictionary atoms ``m``.
        k: number of active latents per sample (``1 <= k <= d_sae``).
        activation: ``"topk"`` (ReLU pre-activations, keep the top k) or ``"abstopk"`` (keep the
            k largest magnitudes with their sign).
        encoder: ``"single"`` (one affine map) or ``"multistep"`` (LISTA-style refinement).
        n_steps: refinement steps ``T`` of the multi-step encoder.
        gamma: step matrix ``Γ`` of the multi-step encoder: ``"free"`` (a learned
            ``(d_in, d_sae)`` matrix initialized to ``step_size * W_dec.T``), ``"diag"``
            (``W_dec.T @ diag(s)`` with a learned per-latent ``s``) or ``"tied"``
            (``η W_dec.T`` with a learned scalar ``η``).
        step_size: initial step size of ``Γ``.
        rip: approximate-RIP regularizer: ``"none"``, ``"eig"`` (squared hinge on the extreme
            eigenvalues of ``G_S``) or ``"fro"`` (``‖G_S - I‖_F²``).
        rip_beta: weight of the aRIP term in the loss.
        rip_delta: tolerated eigenvalue spread ``δ`` of the ``"eig"`` penalty.
        rip_max_supports: at most this many distinct batch supports enter the penalty.
        auxk_alpha: weight of the AuxK dead-latent loss (0 disables it; Gao et al. use 1/32).
        k_aux: number of dead latents used by AuxK (0 means ``min(d_sae, max(2k, d_in // 2))``).
        dead_tokens: a latent is dead when it has not fired on this many training samples.
        b_dec_init: ``"mean"``, ``"geometric_median"`` of the first batch, or ``"zeros"``.
        dtype: ``"float32"`` or ``"float64"``.
    """

    d_in: int
    d_sae: int
    k: int
    activation: str = "abstopk"
    encoder: str = "single"
    n_steps: int = 5
    gamma: str = "free"
    step_size: float = 1.0
    rip: str = "none"
    rip_beta: float = 0.0
    rip_delta: float = 0.1
    rip_max_supports: int = 512
    auxk_alpha: float = 0.0
    k_aux: int = 0
    dead_tokens: int = 10_000
    b_dec_init: str = "mean"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("d_in", "d_sae", "k", "n_steps", "rip_max_supports", "k_aux", "dead_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: expected an int, got {value!r}")
        if self.d_in < 1 or self.d_sae < 1:
            raise ValueError(f"d_in, d_sae: expected positive sizes, got d_in={self.d_in}, "
                             f"d_sae={self.d_sae}")
        if not 1 <= self.k <= self.d_sae:
            raise ValueError(f"k: expected 1 <= k <= d_sae={self.d_sae}, got {self.k}")
        if self.n_steps < 0:
            raise ValueError(f"n_steps: expected >= 0, got {self.n_steps}")
        _choice("activation", self.activation, _ACTIVATIONS)
        _choice("encoder", self.encoder, _ENCODERS)
        _choice("gamma", self.gamma, _GAMMAS)
        _choice("rip", self.rip, _RIPS)
        _choice("b_dec_init", self.b_dec_init, _B_DEC_INITS)
        _choice("dtype", self.dtype, tuple(_DTYPES))
        for name in ("step_size", "rip_beta", "rip_delta", "auxk_alpha"):
            value = float(getattr(self, name))
            if not value == value or value in (float("inf"), float("-inf")) or value < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if self.k_aux == 0:
            self.k_aux = min(self.d_sae, max(2 * self.k, self.d_in // 2))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, cfg: dict) -> "SAEConfig":
        """Build from a (possibly larger) flat config dict; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        missing = {"d_in", "d_sae", "k"} - set(cfg)
        if missing:
            raise ValueError(f"cfg: missing required SAE keys {sorted(missing)}")
        return cls(**{k: v for k, v in cfg.items() if k in names})


# --------------------------------------------------------------------------- sparsifiers

def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(n, k)`` of the ``k`` largest ``scores`` per row, deterministic.

    Ties are broken toward the lower latent index (a stable descending sort), so the result is
    the same on CPU and GPU (``torch.topk`` does not specify its tie order).
    """
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """TopK activation (Gao et al. 2024): keep the ``k`` largest pre-activations, then ReLU.

    Args:
        pre: pre-activations ``(n, d_sae)``.
    Returns:
        ``(n, d_sae)`` code with at most ``k`` non-zero (positive) entries per row.
    """
    idx = select_topk(pre, k)
    return torch.zeros_like(pre).scatter(-1, idx, torch.relu(pre.gather(-1, idx)))


def abstopk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """AbsTopK activation: keep the ``k`` entries of largest magnitude with their sign.

    Ties in magnitude go to the lower latent index (see :func:`select_topk`).
    """
    idx = select_topk(pre.abs(), k)
    return torch.zeros_like(pre).scatter(-1, idx, pre.gather(-1, idx))


# --------------------------------------------------------------------------- aRIP

def _gram_of_supports(W_dec: torch.Tensor, supports: torch.Tensor) -> torch.Tensor:
    atoms = W_dec[supports]                       # (s, k, d_in)
    return atoms @ atoms.transpose(-1, -2)         # (s, k, k) = D_S^T D_S


def rip_penalty(W_dec: torch.Tensor, supports: torch.Tensor, mode: str = "eig",
                delta: float = 0.1, max_supports: int | None = None) -> torch.Tensor:
    """Approximate-RIP penalty on the Gram submatrices ``G_S = D_S^T D_S`` of observed supports.

    Args:
        W_dec: dictionary ``(d_sae, d_in)`` (atoms are rows).
        supports: ``(n, k)`` long tensor of latent indices (one support per row).
        mode: ``"eig"``: mean over supports of ``relu(λ_max - 1 - δ)² + relu(1 - δ - λ_min)²``
            (batched ``eigvalsh``); ``"fro"``: mean of ``‖G_S - I‖_F²`` (cheaper, penalizes
            every off-diagonal coherence).
        delta: tolerated spread ``δ`` (``"eig"`` only).
        max_supports: use at most this many distinct supports (evenly spaced in sorted order).
    Returns:
        scalar tensor, differentiable in ``W_dec``.

    The RIP of order k with constant δ asks ``(1-δ)‖z‖² <= ‖D z‖² <= (1+δ)‖z‖²`` for every
    k-sparse ``z`` (Candès & Tao 2005), i.e. eigenvalues of every ``G_S`` in ``[1-δ, 1+δ]``;
    the approximate version only checks the supports the encoder actually uses.
    """
    _choice("mode", mode, ("eig", "fro"))
    if supports.ndim != 2:
        raise ValueError(f"supports: expected (n, k), got shape {tuple(supports.shape)}")
    sup = torch.unique(torch.sort(supports, dim=-1).values, dim=0)
    if max_supports is not None and sup.shape[0] > max_supports:
        pick = torch.linspace(0, sup.shape[0] - 1, max_supports).round().long()
        sup = sup[pick]
    gram = _gram_of_supports(W_dec, sup)
    if mode == "fro":
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        return ((gram - eye) ** 2).sum(dim=(-1, -2)).mean()
    ev = torch.linalg.eigvalsh(gram)
    hi = torch.relu(ev[:, -1] - 1.0 - delta) ** 2
    lo = torch.relu(1.0 - delta - ev[:, 0]) ** 2
    return (hi + lo).mean()


@torch.no_grad()
def rip_constants(W_dec: torch.Tensor, codes: torch.Tensor) -> dict:
    """Empirical RIP constants of ``W_dec`` over the supports observed in ``codes``.

    Args:
        W_dec: ``(d_sae, d_in)`` dictionary.
        codes: ``(n, d_sae)`` codes; the support of a row is its set of non-zero entries.
    Returns:
        dict with ``delta_max`` (max over supports of ``max(λ_max-1, 1-λ_min)``: the RIP
        constant restricted to the observed supports), ``delta_mean``, ``lambda_min`` (min over
        supports), ``lambda_max`` (max), ``n_supports`` (distinct supports of size >= 1).
        Atoms are normalized first (a zero atom stays zero), so the diagonal of ``G_S`` is 1.
    """
    W = W_dec.detach().double()
    W = W / W.norm(dim=1, keepdim=True).clamp_min(1e-12)
    mask = codes.detach() != 0
    sizes = mask.sum(dim=1)
    deltas, lmins, lmaxs = [], [], []
    for s in torch.unique(sizes).tolist():
        if s == 0:
            continue
        rows = mask[sizes == s]
        sup = torch.unique(torch.nonzero(rows)[:, 1].reshape(-1, s), dim=0)
        ev = torch.linalg.eigvalsh(_gram_of_supports(W, sup))
        lmins.append(ev[:, 0])
        lmaxs.append(ev[:, -1])
        deltas.append(torch.maximum(ev[:, -1] - 1.0, 1.0 - ev[:, 0]))
    if not deltas:
        return {"delta_max": 0.0, "delta_mean": 0.0, "lambda_min": 1.0, "lambda_max": 1.0,
                "n_supports": 0}
    d = torch.cat(deltas)
    return {"delta_max": float(d.max()), "delta_mean": float(d.mean()),
            "lambda_min": float(torch.cat(lmins).min()), "lambda_max": float(torch.cat(lmaxs).max()),
            "n_supports": int(d.numel())}


def geometric_median(x: torch.Tensor, iters: int = 100, eps: float = 1e-8) -> torch.Tensor:
    """Geometric median of the rows of ``x`` (Weiszfeld's algorithm, ``iters`` iterations)."""
    med = x.mean(dim=0)
    for _ in range(iters):
        w = 1.0 / (x - med).norm(dim=1).clamp_min(eps)
        new = (w[:, None] * x).sum(dim=0) / w.sum()
        if torch.allclose(new, med, atol=1e-10, rtol=0):
            return new
        med = new
    return med


# --------------------------------------------------------------------------- model

class SparseAutoencoder(nn.Module):
    """A k-sparse autoencoder (TopK or AbsTopK; single- or multi-step encoder).

    Parameters (names as in SAELens): ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``,
    ``W_dec (d_sae, d_in)``, ``b_dec (d_in,)``; with ``encoder="multistep"`` also ``W_step``
    (``gamma="free"``, ``(d_in, d_sae)``) or ``step_scale`` (``"diag"``: ``(d_sae,)``,
    ``"tied"``: ``(1,)``).

    Multi-step encoder (LISTA-style): ``z_0 = act(W_enc(x - b_dec) + b_enc)``, then for
    ``t = 1..T``: ``z_t = act(z_{t-1} + Γ(x - b_dec - W_dec z_{t-1}))`` — in row convention
    ``z_t = act(z_{t-1} + r_t @ Γ)`` with residual ``r_t = x - b_dec - z_{t-1} @ W_dec``.

    ``seed`` (an int >= 0, or None for the global torch RNG) seeds the initial decoder through
    the ``"init"`` stream of :func:`tensoralg.sae._seeds.stream_seed`, independent of the
    ``"data"`` stream of :func:`~tensoralg.sae.synthetic.make_synthetic` with the same number.
    """

    def __init__(self, cfg: SAEConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        dtype = _DTYPES[cfg.dtype]
        # the "init" stream: independent of make_synthetic's "data" stream for the same seed
        gen = stream_generator(seed, "init") if seed is not None else None
        W_dec = torch.randn(cfg.d_sae, cfg.d_in, generator=gen, dtype=torch.float64)
        W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(W_dec.to(dtype))
        self.W_enc = nn.Parameter(W_dec.T.clone().to(dtype))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_in, dtype=dtype))
        if cfg.encoder == "multistep":
            if cfg.gamma == "free":
                self.W_step = nn.Parameter(cfg.step_size * W_dec.T.clone().to(dtype))
            elif cfg.gamma == "diag":
                self.step_scale = nn.Parameter(torch.full((cfg.d_sae,), cfg.step_size, dtype=dtype))
            else:
                self.step_scale = nn.Parameter(torch.full((1,), cfg.step_size, dtype=dtype))

    # -- parts ---------------------------------------------------------------------------
    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        return abstopk(pre, self.cfg.k) if self.cfg.activation == "abstopk" else topk(pre, self.cfg.k)

    def step_matrix(self) -> torch.Tensor:
        """The multi-step encoder's ``Γ`` in row convention, ``(d_in, d_sae)``."""
        if self.cfg.gamma == "free":
            return self.W_step
        return self.W_dec.T * self.step_scale

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Codes ``(n, d_sae)`` of ``x (n, d_in)`` (at most ``k`` non-zeros per row)."""
        z = self.activation(self.pre_activation(x))
        if self.cfg.encoder == "multistep" and self.cfg.n_steps > 0:
            gamma = self.step_matrix()
            xc = x - self.b_dec
            for _ in range(self.cfg.n_steps):
                z = self.activation(z + (xc - z @ self.W_dec) @ gamma)
        return z

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    # -- training helpers ------------------------------------------------------------------
    def check_input(self, x: torch.Tensor, name: str = "x") -> None:
        if x.ndim != 2 or x.shape[1] != self.cfg.d_in:
            raise ValueError(f"{name}: expected shape (n, d_in={self.cfg.d_in}), got {tuple(x.shape)}")

    def loss(self, x: torch.Tensor, dead_mask: torch.Tensor | None = None) -> dict:
        """Training loss and its parts on a batch ``x (n, d_in)``.

        ``recon`` is the batch fraction of variance unexplained
        ``Σ‖x - x_hat‖² / Σ‖x - mean(x)‖²``; ``rip`` the aRIP penalty on the batch supports
        (weight ``rip_beta``); ``aux`` the AuxK loss (Gao et al. 2024, weight ``auxk_alpha``):
        the ``k_aux`` dead latents of largest pre-activation (largest magnitude for AbsTopK)
        reconstruct the residual ``x - x_hat``, normalized by ``Σ‖x - x_hat‖²``.
        Returns a dict with ``loss`` (scalar), ``recon``, ``rip``, ``aux`` (scalars) and ``z``.
        """
        cfg = self.cfg
        z = self.encode(x)
        x_hat = self.decode(z)
        var = ((x - x.mean(dim=0)) ** 2).sum().clamp_min(1e-12)
        recon = ((x - x_hat) ** 2).sum() / var
        total = recon
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        rip = zero
        if cfg.rip != "none" and cfg.rip_beta > 0:
            score = z.detach().abs()
            supports = select_topk(score, cfg.k)
            rip = rip_penalty(self.W_dec, supports, cfg.rip, cfg.rip_delta, cfg.rip_max_supports)
            total = total + cfg.rip_beta * rip
        aux = zero
        if cfg.auxk_alpha > 0 and dead_mask is not None and bool(dead_mask.any()):
            pre = self.pre_activation(x)
            score = pre.abs() if cfg.activation == "abstopk" else pre
            score = score.masked_fill(~dead_mask, float("-inf"))
            k_aux = min(cfg.k_aux, int(dead_mask.sum()))
            idx = select_topk(score, k_aux)
            vals = pre.gather(-1, idx)
            if cfg.activation == "topk":
                vals = torch.relu(vals)
            z_aux = torch.zeros_like(pre).scatter(-1, idx, vals)
            resid = (x - x_hat).detach()
            aux = ((resid - z_aux @ self.W_dec) ** 2).sum() / (resid ** 2).sum().clamp_min(1e-12)
            total = total + cfg.auxk_alpha * aux
        return {"loss": total, "recon": recon.detach(), "rip": rip.detach(), "aux": aux.detach(), "z": z}

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Rescale every atom (row of ``W_dec``) to unit norm; a zero atom is left at zero."""
        norms = self.W_dec.norm(dim=1, keepdim=True)
        self.W_dec.div_(torch.where(norms > 0, norms, torch.ones_like(norms)))

    @torch.no_grad()
    def remove_parallel_grad_(self) -> None:
        """Project out of ``W_dec.grad`` the component along each (unit) atom (Gao et al. 2024)."""
        g = self.W_dec.grad
        if g is None:
            return
        w = self.W_dec
        g.sub_((g * w).sum(dim=1, keepdim=True) * w)

    @torch.no_grad()
    def init_b_dec(self, x: torch.Tensor) -> None:
        """Set ``b_dec`` from a data sample ``x (n, d_in)`` per ``cfg.b_dec_init``."""
        self.check_input(x)
        if self.cfg.b_dec_init == "mean":
            self.b_dec.copy_(x.mean(dim=0))
        elif self.cfg.b_dec_init == "geometric_median":
            self.b_dec.copy_(geometric_median(x.double()).to(self.b_dec.dtype))

    def tensors(self) -> dict:
        """Named parameters for ``weights.safetensors`` (SAELens names)."""
        return {name: p.detach() for name, p in self.named_parameters()}

    def library_cfg(self) -> dict:
        """Flat ``cfg.json`` entries: the :class:`SAEConfig` plus SAELens-style keys."""
        cfg = self.cfg.to_dict()
        cfg.update({"architecture": "isae" if (self.cfg.activation == "abstopk" or
                                                self.cfg.encoder == "multistep") else "topk",
                    "activation_fn": self.cfg.activation, "apply_b_dec_to_input": True,
                    "normalize_activations": "none", "device": "cpu"})
        return cfg
