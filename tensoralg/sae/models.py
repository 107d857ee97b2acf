"""Sparse-autoencoder models: TopK, AbsTopK, multi-step (LISTA-style) encoder, aRIP regularizer.

Conventions (as in the common SAE libraries, e.g. SAELens / OpenAI ``sparse_autoencoder``):

* ``W_enc``: ``(d_in, d_sae)``, ``b_enc``: ``(d_sae,)``, ``W_dec``: ``(d_sae, d_in)``,
  ``b_dec``: ``(d_in,)``; activations are rows ``x`` of shape ``(n, d_in)``.
* encode: ``z = act((x - b_dec) @ W_enc + b_enc)``; decode: ``x_hat = z @ W_dec + b_dec``.
* The dictionary atoms are the rows of ``W_dec``, kept at unit ℓ2 norm (renormalized after
  every optimizer step, gradient component along each atom removed before it).

Sources: TopK SAE — Gao et al., "Scaling and evaluating sparse autoencoders" (2024), incl. the
AuxK dead-latent loss; AbsTopK / aRIP / multi-step encoder — the identifiable-SAE (iSAE)
recipe; LISTA — Gregor & LeCun, "Learning Fast Approximations of Sparse Coding" (ICML 2010);
restricted isometry property — Candès & Tao, "Decoding by linear programming" (2005).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._seeds import stream_generator

__all__ = ["SAEConfig", "SparseAutoencoder", "select_topk", "select_topk_sort", "topk", "abstopk", "rip_penalty",
           "rip_constants", "geometric_median", "unique_rows", "unique_rows_reference",
           "code_supports"]

_ACTIVATIONS = ("topk", "abstopk", "relu", "jumprelu")
DENSE_ACTIVATIONS = ("relu", "jumprelu")      # read from SAELens folders; inference only
_ENCODERS = ("single", "multistep")
_GAMMAS = ("free", "diag", "tied")
_RIPS = ("none", "eig", "fro")
_B_DEC_INITS = ("mean", "geometric_median", "zeros")
_NORMALIZATIONS = ("none", "layer_norm")
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
            k largest magnitudes with their sign); for inference on SAELens folders also
            ``"relu"`` (SAELens ``standard``: ``z = relu(pre)``) and ``"jumprelu"`` (SAELens
            ``jumprelu``, also what its BatchTopK trainers save: ``z = relu(pre) · [pre > θ]``
            with a per-latent ``threshold`` θ; Rajamanoharan et al., "Jumping Ahead", 2024).
            These two have no cap on the number of active latents: ``k`` must equal
            ``d_sae``, the encoder must be ``"single"``, and they cannot be trained here.
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
        normalize_activations: ``"none"`` or ``"layer_norm"`` (as SAELens: every input row is
            centred and divided by its unbiased standard deviation plus ``1e-5`` before
            encoding; [`SparseAutoencoder.forward`][tensoralg.sae.models.SparseAutoencoder.forward]
            maps the reconstruction back).
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
    normalize_activations: str = "none"

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
        _choice("normalize_activations", self.normalize_activations, _NORMALIZATIONS)
        if self.activation in DENSE_ACTIVATIONS and (self.k != self.d_sae
                                                     or self.encoder != "single"):
            raise ValueError(f"activation={self.activation!r}: expected k == d_sae={self.d_sae} "
                             f"(no top-k cap) and encoder='single', got k={self.k}, "
                             f"encoder={self.encoder!r}")
        for name in ("step_size", "rip_beta", "rip_delta", "auxk_alpha"):
            value = float(getattr(self, name))
            if not value == value or value in (float("inf"), float("-inf")) or value < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if self.k_aux == 0:
            self.k_aux = min(self.d_sae, max(2 * self.k, self.d_in // 2))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, cfg: dict) -> SAEConfig:
        """Build from a (possibly larger) flat config dict; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        missing = {"d_in", "d_sae", "k"} - set(cfg)
        if missing:
            raise ValueError(f"cfg: missing required SAE keys {sorted(missing)}")
        return cls(**{k: v for k, v in cfg.items() if k in names})


# --------------------------------------------------------------------------- sparsifiers

def select_topk_sort(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Reference for [`select_topk`][tensoralg.sae.models.select_topk]: a full stable descending
    sort, ``O(m log m)`` per row.

    Kept as the independent definition the fast path is tested and benchmarked against.
    """
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def select_topk(scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """Indices ``(n, k)`` of the ``k`` largest ``scores`` per row, deterministic.

    Ties are broken toward the lower latent index, and the indices come in the order of a
    stable descending sort (value descending, then index ascending), so the result equals
    [`select_topk_sort`][tensoralg.sae.models.select_topk_sort] exactly, on CPU and GPU
    (``torch.topk`` does not specify its tie order). Fast path: ``torch.topk`` of ``k + 1`` entries;
    a row whose ``k``-th and ``(k+1)``-th largest values are equal (a tie at the boundary, where the
    set itself depends on the tie rule) is redone with the stable sort. The ``k`` selected entries
    are then put in stable order by two sorts of length ``k``.

    Args:
        scores: ``(..., m)`` scores (detached inside); ``k``: ``1 <= k <= m``.
        ordered: put the indices in stable-sort order (``False``: the same set per row, in an
            unspecified order — enough for a scatter, and two small sorts cheaper).
    Returns:
        long tensor ``(..., k)``.
    """
    scores = scores.detach()
    m = scores.shape[-1]
    if not 1 <= k <= m:
        raise ValueError(f"k: expected 1 <= k <= {m} (the last dimension of scores "
                         f"{tuple(scores.shape)}), got {k}")
    if k == m or scores.ndim != 2:
        return select_topk_sort(scores, k)
    vals, idx = torch.topk(scores, k + 1, dim=-1, largest=True, sorted=True)
    a, b = vals[:, k - 1], vals[:, k]
    tie = (a == b) | (torch.isnan(a) & torch.isnan(b))   # sort and topk both rank NaN largest
    idx = idx[:, :k]
    if ordered:
        # stable order inside the selected set: index ascending, then value descending (stable)
        idx = torch.sort(idx, dim=-1).values
        inner = torch.sort(scores.gather(-1, idx), dim=-1, descending=True, stable=True).indices
        idx = idx.gather(-1, inner)
    if bool(tie.any()):
        rows = tie.nonzero().squeeze(-1)
        idx[rows] = select_topk_sort(scores[rows], k)
    return idx


def topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """TopK activation (Gao et al. 2024): keep the ``k`` largest pre-activations, then ReLU.

    Args:
        pre: pre-activations ``(n, d_sae)``.
    Returns:
        ``(n, d_sae)`` code with at most ``k`` non-zero (positive) entries per row.
    """
    idx = select_topk(pre, k, ordered=False)
    return torch.zeros_like(pre).scatter_(-1, idx, torch.relu(pre.gather(-1, idx)))


def abstopk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """AbsTopK activation: keep the ``k`` entries of largest magnitude with their sign.

    Ties in magnitude go to the lower latent index (see
    [`select_topk`][tensoralg.sae.models.select_topk]).
    """
    idx = select_topk(pre.abs(), k, ordered=False)
    return torch.zeros_like(pre).scatter_(-1, idx, pre.gather(-1, idx))


def _dense(idx: torch.Tensor, vals: torch.Tensor, m: int) -> torch.Tensor:
    """The ``(n, m)`` code with ``vals (n, k)`` at ``idx (n, k)`` and zeros elsewhere."""
    return torch.zeros(idx.shape[0], m, dtype=vals.dtype, device=vals.device).scatter(-1, idx, vals)


# --------------------------------------------------------------------------- aRIP

def _gram_of_supports(W_dec: torch.Tensor, supports: torch.Tensor) -> torch.Tensor:
    atoms = W_dec[supports]                       # (s, k, d_in)
    return atoms @ atoms.transpose(-1, -2)         # (s, k, k) = D_S^T D_S


def unique_rows(rows: torch.Tensor) -> torch.Tensor:
    """Distinct rows of an integer matrix ``(n, k)`` in ascending lexicographic order.

    Equal to ``torch.unique(rows, dim=0)`` (the reference,
    [`unique_rows_reference`][tensoralg.sae.models.unique_rows_reference]) but computed as a radix
    sort: ``k`` stable sorts of length ``n`` (last column first), then a comparison of neighbours —
        several times faster on CPU for the small ``k`` of a support.
    """
    if rows.ndim != 2:
        raise ValueError(f"rows: expected (n, k), got shape {tuple(rows.shape)}")
    n, k = rows.shape
    if n == 0 or k == 0:
        return unique_rows_reference(rows)
    order = torch.arange(n, device=rows.device)
    for j in range(k - 1, -1, -1):
        order = order[torch.sort(rows[order, j], stable=True).indices]
    srt = rows[order]
    keep = torch.ones(n, dtype=torch.bool, device=rows.device)
    keep[1:] = (srt[1:] != srt[:-1]).any(dim=1)
    return srt[keep]


def unique_rows_reference(rows: torch.Tensor) -> torch.Tensor:
    """``torch.unique(rows, dim=0)``: the definition
    [`unique_rows`][tensoralg.sae.models.unique_rows] is tested against."""
    return torch.unique(rows, dim=0)


def code_supports(z: torch.Tensor, k: int) -> torch.Tensor:
    """Supports ``(n, k)`` of codes ``z (n, m)``: the indices of the ``k`` largest ``|z|``.

    Equal (as sets per row) to ``select_topk(z.abs(), k)``; when every row has exactly ``k``
    non-zeros (the usual case for TopK/AbsTopK codes) they are read off the non-zeros in
    index order, without a selection.
    """
    nz = z.detach() != 0
    if z.ndim == 2 and bool((nz.sum(dim=1) == k).all()):
        return torch.nonzero(nz)[:, 1].reshape(z.shape[0], k)
    return select_topk(z.detach().abs(), k)


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
    sup = unique_rows(torch.sort(supports, dim=-1).values)
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
    the ``"init"`` stream of `tensoralg.sae._seeds.stream_seed`, independent of the
    ``"data"`` stream of [`make_synthetic`][tensoralg.sae.synthetic.make_synthetic] with the same
    number.
    """

    def __init__(self, cfg: SAEConfig, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        # refinement steps actually run (None: cfg.n_steps); the trainer sets 0 before
        # TrainConfig.multistep_start
        self.refine_steps: int | None = None
        dtype = _DTYPES[cfg.dtype]
        # the "init" stream: independent of make_synthetic's "data" stream for the same seed
        gen = stream_generator(seed, "init") if seed is not None else None
        W_dec = torch.randn(cfg.d_sae, cfg.d_in, generator=gen, dtype=torch.float64)
        W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(W_dec.to(dtype))
        self.W_enc = nn.Parameter(W_dec.T.clone().to(dtype))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_in, dtype=dtype))
        # model / hook / data this SAE was trained on (cfg.json "metadata", as SAELens)
        self.metadata: dict = {}
        # the folder it was loaded from (load_sae); named in errors
        self.source: str | None = None
        if cfg.activation == "jumprelu":
            self.threshold = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))
        if cfg.encoder == "multistep":
            if cfg.gamma == "free":
                self.W_step = nn.Parameter(cfg.step_size * W_dec.T.clone().to(dtype))
            elif cfg.gamma == "diag":
                self.step_scale = nn.Parameter(torch.full((cfg.d_sae,), cfg.step_size, dtype=dtype))
            else:
                self.step_scale = nn.Parameter(torch.full((1,), cfg.step_size, dtype=dtype))

    # -- parts ---------------------------------------------------------------------------
    def activation(self, pre: torch.Tensor) -> torch.Tensor:
        act = self.cfg.activation
        if act in DENSE_ACTIVATIONS:
            z = torch.relu(pre)
            return z * (pre > self.threshold).to(z.dtype) if act == "jumprelu" else z
        return abstopk(pre, self.cfg.k) if act == "abstopk" else topk(pre, self.cfg.k)

    def step_matrix(self) -> torch.Tensor:
        """The multi-step encoder's ``Γ`` in row convention, ``(d_in, d_sae)``."""
        if self.cfg.gamma == "free":
            return self.W_step
        return self.W_dec.T * self.step_scale

    def normalize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                        torch.Tensor | None]:
        """``(x_n, mu, std)``: ``x`` as the encoder sees it. With ``"layer_norm"``
        ``x_n = (x - mu) / (std + 1e-5)`` per row (``std`` unbiased, as SAELens); otherwise
        ``x_n = x`` and ``mu = std = None``."""
        if self.cfg.normalize_activations != "layer_norm":
            return x, None, None
        mu = x.mean(dim=-1, keepdim=True)
        xc = x - mu
        std = xc.std(dim=-1, keepdim=True)
        return xc / (std + 1e-5), mu, std

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def describe(self) -> str:
        """How errors name this SAE: its folder when it has one (``source``, set by
        ``load_sae``), else its architecture and sizes."""
        c = self.cfg
        if self.source:
            return f"SAE {self.source}"
        enc = "multi-step " if c.encoder == "multistep" else ""
        return f"{enc}{c.activation} SAE (d_in={c.d_in}, d_sae={c.d_sae}, k={c.k})"

    def _rows_of(self, x, width: int, what: str, name: str) -> tuple[torch.Tensor, tuple]:
        """``x (..., width)`` as rows ``(N, width)`` and its leading shape ``...``.

        Raises:
            ValueError: ``x`` not a tensor, 0-dimensional, or with a last dimension other than
                ``width`` (one line naming ``what``, the shape given and `describe`).
        """
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor (..., {what}={width}) for "
                             f"{self.describe()}, got {type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] != width:
            raise ValueError(f"{name}: expected shape (..., {what}={width}) for "
                             f"{self.describe()}, got {tuple(x.shape)}")
        return x.reshape(-1, width), tuple(x.shape[:-1])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Codes ``(..., d_sae)`` of ``x (..., d_in)`` (at most ``k`` non-zeros per row).

        Any leading dimensions, as SAELens: ``x`` is flattened to rows ``(N, d_in)``, encoded,
        and the codes get ``x``'s leading shape back (so a ``(batch, seq, d_in)`` input equals
        encoding its rows one by one; a 1-D ``(d_in,)`` input gives a ``(d_sae,)`` code).

        Raises:
            ValueError: the last dimension of ``x`` is not ``d_in`` (or ``x`` is a scalar / not
                a tensor): one line naming ``d_in``, the shape given and the SAE.
        """
        rows, lead = self._rows_of(x, self.cfg.d_in, "d_in", "x")
        return self._encode(rows)[0].reshape(lead + (self.cfg.d_sae,))

    def _encode(self, x: torch.Tensor, normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, first pre-activation)``; the loss reuses the latter for AuxK."""
        if not normalized:
            x = self.normalize_input(x)[0]
        if self.cfg.activation in DENSE_ACTIVATIONS:
            pre = self.pre_activation(x)
            return self.activation(pre), pre
        idx, vals, pre = self._encode_sparse(x)
        return _dense(idx, vals, self.cfg.d_sae), pre

    def _select(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation in sparse form: ``(idx, vals)``, both ``(n, k)``, with
        ``activation(pre) == zeros.scatter(-1, idx, vals)`` (same selection and tie rule)."""
        k = self.cfg.k
        if self.cfg.activation == "abstopk":
            idx = select_topk(pre.detach().abs(), k, ordered=False)   # no autograd node for |pre|
            return idx, pre.gather(-1, idx)
        idx = select_topk(pre.detach(), k, ordered=False)
        return idx, torch.relu(pre.gather(-1, idx))

    def _decode_sparse(self, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """``zeros.scatter(-1, idx, vals) @ W_dec`` (no ``b_dec``) without the dense code:
        ``embedding_bag`` sums the ``k`` selected atoms per row (``n k d`` multiply-adds
        instead of ``n m d``); differentiable in ``vals`` and ``W_dec``."""
        # (under torch.autocast the codes may be in a lower dtype than W_dec: cast; a no-op
        # otherwise)
        return F.embedding_bag(idx, self.W_dec, per_sample_weights=vals.to(self.W_dec.dtype),
                               mode="sum")

    def _encode_sparse(self, x: torch.Tensor):
        """``(idx, vals, pre)`` of already normalized ``x``: the code in sparse form and the
        first pre-activation. The multi-step refinement
        ``z_t = act(z_{t-1} + (x - b_dec - z_{t-1} W_dec) Γ)`` is computed as
        ``act(scatter_add((x - b_dec) Γ - z_{t-1} (W_dec Γ), z_{t-1}))`` with ``(x - b_dec) Γ``
        and ``W_dec Γ`` ``(d_sae, d_sae)`` formed once per call and ``z_{t-1} (W_dec Γ)`` summed
        over the ``k`` selected rows (``embedding_bag``): ``n d m + m d m + T n k m``
        multiply-adds instead of ``T n (d m + k d)``. It is used when that is fewer (large
        batches; small ones, e.g. inference on a few rows, keep ``(x - b_dec - z W_dec) Γ``
        per step); both are the same sums in another order (equal to rounding)."""
        pre = self.pre_activation(x)
        idx, vals = self._select(pre)
        n_steps = self.cfg.n_steps if self.refine_steps is None else self.refine_steps
        if self.cfg.encoder == "multistep" and n_steps > 0:
            gamma = self.step_matrix()
            xc = x - self.b_dec
            n, d, m, k = x.shape[0], self.cfg.d_in, self.cfg.d_sae, self.cfg.k
            if n * d * m + m * d * m + n_steps * n * k * m < n_steps * n * (d * m + k * d):
                base, dec_gamma = xc @ gamma, self.W_dec @ gamma
                for _ in range(n_steps):
                    step = base - F.embedding_bag(idx, dec_gamma, mode="sum",
                                                  per_sample_weights=vals.to(dec_gamma.dtype))
                    idx, vals = self._select(step.scatter_add(-1, idx, vals.to(step.dtype)))
            else:
                for _ in range(n_steps):
                    step = (xc - self._decode_sparse(idx, vals)) @ gamma
                    idx, vals = self._select(step.scatter_add(-1, idx, vals.to(step.dtype)))
        return idx, vals, pre

    def input_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, std)``, each ``(..., 1)``: the per-row statistics a ``layer_norm`` SAE
        normalizes ``x (..., d_in)`` with (mean, unbiased standard deviation; see
        `normalize_input`) — what `decode` needs to map codes back to ``x``'s space.

        Raises:
            ValueError: an SAE without ``layer_norm``; ``x`` of another width (as `encode`).
        """
        if self.cfg.normalize_activations != "layer_norm":
            raise ValueError(f"input_stats: {self.describe()} has normalize_activations="
                             f"{self.cfg.normalize_activations!r}; only 'layer_norm' SAEs "
                             f"normalize their inputs")
        rows, lead = self._rows_of(x, self.cfg.d_in, "d_in", "x")
        _, mu, std = self.normalize_input(rows)
        return mu.reshape(lead + (1,)), std.reshape(lead + (1,))

    def decode(self, z: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None,
               normalized: bool = False) -> torch.Tensor:
        """``z @ W_dec + b_dec``: the reconstruction ``(..., d_in)`` of codes ``z (..., d_sae)``
        (any leading dimensions, kept).

        With ``normalize_activations="layer_norm"`` the codes live in the normalized space
        (every input row centred and scaled, `normalize_input`), so the reconstruction of
        ``x`` is ``(z W_dec + b_dec) · std + mu`` with ``x``'s own row statistics: give
        ``stats=sae.input_stats(x)`` (then ``decode(encode(x), stats)`` equals ``forward(x)``
        and SAELens's ``decode`` after ``encode(x)``, which keeps those statistics from its
        last ``encode`` call), or ``normalized=True`` for ``z W_dec + b_dec`` in the normalized
        space. Without either, a ``layer_norm`` SAE refuses to decode (the statistics are not
        in the codes; SAELens's implicit state is not kept here).

        Raises:
            ValueError: the last dimension of ``z`` is not ``d_sae`` (one line naming it, the
                shape given and the SAE); a ``layer_norm`` SAE given neither ``stats`` nor
                ``normalized=True``; ``stats`` (or ``normalized``) for an SAE without
                ``layer_norm``; ``stats`` whose shapes are not ``z``'s leading shape + ``(1,)``.
        """
        rows, lead = self._rows_of(z, self.cfg.d_sae, "d_sae", "z")
        out = rows @ self.W_dec + self.b_dec
        if self.cfg.normalize_activations != "layer_norm":
            if stats is not None or normalized:
                raise ValueError(f"decode: stats/normalized are for layer_norm SAEs; "
                                 f"{self.describe()} has normalize_activations="
                                 f"{self.cfg.normalize_activations!r}")
        elif stats is not None:
            if normalized:
                raise ValueError("decode: give stats (the reconstruction in x's space) or "
                                 "normalized=True (in the normalized space), not both")
            mu, std = stats
            want = lead + (1,)
            if tuple(mu.shape) != want or tuple(std.shape) != want:
                raise ValueError(f"stats: expected (mu, std) of shape {want} (z's leading "
                                 f"shape, from input_stats(x)), got {tuple(mu.shape)} and "
                                 f"{tuple(std.shape)}")
            out = out * std.reshape(-1, 1) + mu.reshape(-1, 1)
        elif not normalized:
            raise ValueError(f"decode: {self.describe()} normalizes each input row "
                             f"(normalize_activations='layer_norm'), and the codes do not hold "
                             f"the row statistics: call decode(z, stats=sae.input_stats(x)) for "
                             f"the reconstruction of x (what SAELens's decode returns after "
                             f"encode(x)), decode(z, normalized=True) for the normalized space, "
                             f"or forward(x)")
        return out.reshape(lead + (self.cfg.d_in,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruction ``(..., d_in)`` of ``x (..., d_in)`` in the input's own space (any
        leading dimensions, as `encode`).

        Raises:
            ValueError: as `encode`.
        """
        rows, lead = self._rows_of(x, self.cfg.d_in, "d_in", "x")
        xn, mu, std = self.normalize_input(rows)
        out = self._encode(xn, normalized=True)[0] @ self.W_dec + self.b_dec
        out = out if mu is None else out * std + mu
        return out.reshape(lead + (self.cfg.d_in,))

    # -- training helpers ------------------------------------------------------------------
    def check_input(self, x: torch.Tensor, name: str = "x") -> None:
        if x.ndim != 2 or x.shape[1] != self.cfg.d_in:
            raise ValueError(f"{name}: expected shape (n, d_in={self.cfg.d_in}), got {tuple(x.shape)}")

    def loss(self, x: torch.Tensor, dead_mask: torch.Tensor | None = None,
             rip_coef: float | None = None, aux_coef: float | None = None) -> dict:
        """Training loss and its parts on a batch ``x (n, d_in)``.

        ``recon`` is the batch fraction of variance unexplained
        ``Σ‖x - x_hat‖² / Σ‖x - mean(x)‖²``; ``rip`` the aRIP penalty on the batch supports
        (weight ``rip_beta``); ``aux`` the AuxK loss (Gao et al. 2024, weight ``auxk_alpha``):
        the ``k_aux`` dead latents of largest pre-activation (largest magnitude for AbsTopK)
        reconstruct the residual ``x - x_hat``, normalized by ``Σ‖x - x_hat‖²``.
        ``rip_coef`` / ``aux_coef`` replace ``rip_beta`` / ``auxk_alpha`` (coefficient warmup).
        Returns a dict with ``loss`` (scalar), ``recon``, ``rip``, ``aux`` (scalars) and ``z``.
        """
        cfg = self.cfg
        if cfg.activation in DENSE_ACTIVATIONS:
            raise ValueError(f"activation={cfg.activation!r}: SAEs read from SAELens "
                             f"'standard'/'jumprelu' folders are for inference; training "
                             f"supports {[a for a in _ACTIVATIONS if a not in DENSE_ACTIVATIONS]}")
        x = self.normalize_input(x)[0]
        idx, vals, pre = self._encode_sparse(x)
        z = _dense(idx, vals, cfg.d_sae)
        x_hat = self._decode_sparse(idx, vals) + self.b_dec
        var = ((x - x.mean(dim=0)) ** 2).sum().clamp_min(1e-12)
        recon = ((x - x_hat) ** 2).sum() / var
        total = recon
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        rip = zero
        rip_coef = cfg.rip_beta if rip_coef is None else rip_coef
        aux_coef = cfg.auxk_alpha if aux_coef is None else aux_coef
        if cfg.rip != "none" and cfg.rip_beta > 0:
            # the selected indices are the support whenever every selected value is non-zero
            # (then equal to code_supports(z) as sets per row, which is all rip_penalty uses)
            supports = idx if bool((vals != 0).all()) else code_supports(z, cfg.k)
            rip = rip_penalty(self.W_dec, supports, cfg.rip, cfg.rip_delta, cfg.rip_max_supports)
            total = total + rip_coef * rip
        aux = zero
        if cfg.auxk_alpha > 0 and dead_mask is not None and bool(dead_mask.any()):
            score = pre.abs() if cfg.activation == "abstopk" else pre
            score = score.masked_fill(~dead_mask, float("-inf"))
            k_aux = min(cfg.k_aux, int(dead_mask.sum()))
            aidx = select_topk(score, k_aux, ordered=False)
            avals = pre.gather(-1, aidx)
            if cfg.activation == "topk":
                avals = torch.relu(avals)
            resid = (x - x_hat).detach()
            aux = (((resid - self._decode_sparse(aidx, avals)) ** 2).sum() /
                   (resid ** 2).sum().clamp_min(1e-12))
            total = total + aux_coef * aux
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

    @torch.no_grad()
    def init_from_samples_(self, x: torch.Tensor) -> None:
        """Decoder initialization from data: atom ``j`` = normalized ``x_j - b_dec`` for the
        first ``d_sae`` rows of ``x (n, d_in)`` (``n >= d_sae``, rows already normalized as
        the encoder sees them); ``W_enc = W_dec^T``, a free ``Γ`` = ``step_size W_dec^T``.

        Raises:
            ValueError: fewer rows than latents, or a row equal to ``b_dec`` (zero direction).
        """
        self.check_input(x)
        m = self.cfg.d_sae
        if x.shape[0] < m:
            raise ValueError(f"x: decoder initialization from samples needs at least d_sae={m} "
                             f"rows, got {x.shape[0]}")
        dirs = (x[:m] - self.b_dec).to(self.W_dec.dtype)
        norms = dirs.norm(dim=1, keepdim=True)
        if not bool((norms > 0).all()):
            raise ValueError("x: a sample equals b_dec (zero direction); cannot initialize an atom")
        self.set_latents_(torch.arange(m, device=self.W_dec.device), dirs / norms, 1.0)

    @torch.no_grad()
    def set_latents_(self, latents: torch.Tensor, atoms: torch.Tensor, enc_norm: float) -> None:
        """Point latents ``latents (r,)`` at unit ``atoms (r, d_in)``: decoder rows = atoms,
        encoder columns = ``enc_norm`` × atoms, ``b_enc = 0``, a free ``Γ``'s columns =
        ``step_size`` × atoms (the initialization of a fresh latent)."""
        self.W_dec[latents] = atoms
        self.W_enc[:, latents] = enc_norm * atoms.T
        self.b_enc[latents] = 0.0
        if self.cfg.encoder == "multistep" and self.cfg.gamma == "free":
            self.W_step[:, latents] = self.cfg.step_size * atoms.T
