"""SparseAutoencoder.encode / decode / forward take any leading dimensions (as SAELens):
equal to the row-by-row result, shapes restored; a wrong width is one ValueError naming
``d_in`` (``d_sae`` for decode), the shape given and the SAE."""

import pytest
import torch

from tensoralg.sae.formats import load_sae, save_sae
from tensoralg.sae.models import SAEConfig, SparseAutoencoder

D, M, K = 12, 40, 3

ARCHS = {
    "topk": dict(activation="topk"),
    "abstopk": dict(activation="abstopk"),
    "isae-me": dict(activation="abstopk", encoder="multistep", n_steps=3, gamma="free",
                    step_size=0.5),
    "multistep-diag-topk": dict(activation="topk", encoder="multistep", n_steps=2, gamma="diag"),
    "relu": dict(activation="relu", k=M),
    "jumprelu": dict(activation="jumprelu", k=M),
    "abstopk-layer_norm": dict(activation="abstopk", normalize_activations="layer_norm"),
}


def _sae(name: str, dtype: str = "float64") -> SparseAutoencoder:
    kw = {"k": K, **ARCHS[name]}
    sae = SparseAutoencoder(SAEConfig(d_in=D, d_sae=M, dtype=dtype, **kw), seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        sae.b_enc.copy_(0.1 * torch.randn(M, generator=g, dtype=sae.b_enc.dtype))
        sae.b_dec.copy_(0.1 * torch.randn(D, generator=g, dtype=sae.b_dec.dtype))
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(0.05 * torch.rand(M, generator=g, dtype=sae.b_enc.dtype))
    return sae.eval()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_leading_dims_equal_row_by_row(name):
    sae = _sae(name)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        z, xh = sae.encode(x), sae(x)
        assert z.shape == (2, 5, M) and xh.shape == (2, 5, D)
        # exactly the flat (N, d_in) computation, reshaped
        assert torch.equal(z.reshape(-1, M), sae.encode(x.reshape(-1, D)))
        assert torch.equal(xh.reshape(-1, D), sae(x.reshape(-1, D)))
        for b in range(2):
            for t in range(5):
                row = x[b, t][None]
                # one row at a time: the same supports, values equal to rounding (a matmul of
                # another shape may sum in another order)
                zr = sae.encode(row)[0]
                assert torch.equal(z[b, t] != 0, zr != 0)
                torch.testing.assert_close(z[b, t], zr, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(xh[b, t], sae(row)[0], rtol=1e-12, atol=1e-12)
        # decode keeps the leading shape, and equals the flat decode (a layer_norm SAE needs
        # the statistics of the rows the codes came from)
        ln = sae.cfg.normalize_activations == "layer_norm"
        kw = {"stats": sae.input_stats(x)} if ln else {}
        kw1 = {"stats": sae.input_stats(x.reshape(-1, D))} if ln else {}
        dec = sae.decode(z, **kw)
        assert dec.shape == (2, 5, D)
        assert torch.equal(dec.reshape(-1, D), sae.decode(z.reshape(-1, M), **kw1))
        torch.testing.assert_close(dec, xh, rtol=1e-12, atol=1e-12)      # = forward
        # four leading dimensions, and none: a 1-D (d_in,) input gives a (d_sae,) code
        x4 = x.reshape(1, 2, 5, 1, D)
        assert torch.equal(sae.encode(x4).reshape(-1, M), z.reshape(-1, M))
        assert sae.encode(x[0, 0]).shape == (M,) and sae(x[0, 0]).shape == (D,)
        torch.testing.assert_close(sae.encode(x[0, 0]), sae.encode(x[0, :1])[0], rtol=0, atol=0)
        kw = {"stats": sae.input_stats(x[0, 0])} if ln else {}
        assert sae.decode(z[0, 0], **kw).shape == (D,)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_wrong_width_is_one_clear_error(name):
    sae = _sae(name)
    bad = torch.randn(2, 5, D + 5, dtype=torch.float64)
    for fn in (sae.encode, sae.forward):
        with pytest.raises(ValueError, match=rf"^x: expected shape \(\.\.\., d_in={D}\) for "
                                             rf".*SAE \(d_in={D}, d_sae={M}, k=\d+\), got "
                                             rf"\(2, 5, {D + 5}\)$"):
            fn(bad)
    with pytest.raises(ValueError, match=rf"^z: expected shape \(\.\.\., d_sae={M}\) .* got "
                                         rf"\(3, {D}\)$"):
        sae.decode(torch.zeros(3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected shape .* got \(\)$"):
        sae.encode(torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected a torch.Tensor .* got list"):
        sae.encode([0.0] * D)


def test_error_names_the_folder(tmp_path):
    folder = save_sae(tmp_path / "my_sae", _sae("abstopk", "float32"))
    sae = load_sae(folder)
    with pytest.raises(ValueError, match=rf"d_in={D}\) for SAE .*my_sae, got \(4, 7\)"):
        sae.encode(torch.zeros(4, 7))


def test_layer_norm_decode_needs_the_encode_statistics():
    """SAELens's decode un-normalizes with the statistics of its last encode call; here they
    are explicit: decode(encode(x), stats=input_stats(x)) = forward(x) = SAELens's
    (x̂_n · std + mu), normalized=True gives the normalized space, and neither is refused."""
    sae = _sae("abstopk-layer_norm")
    x = 3 * torch.randn(4, 6, D, generator=torch.Generator().manual_seed(2),
                        dtype=torch.float64) + 1
    mu = x.mean(-1, keepdim=True)
    std = (x - mu).std(-1, keepdim=True)
    xn = (x - mu) / (std + 1e-5)
    with torch.no_grad():
        z = sae.encode(x)
        assert torch.equal(_sae("abstopk").encode(xn), z)     # same weights, no layer_norm
        m, s = sae.input_stats(x)
        assert torch.equal(m, mu) and torch.equal(s, std)
        dn = sae.decode(z, normalized=True)
        torch.testing.assert_close(dn, z @ sae.W_dec + sae.b_dec, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sae.decode(z, stats=(m, s)), dn * std + mu,
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sae.decode(z, stats=(m, s)), sae(x), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=r"^decode: .* normalizes each input row .*"
                                             r"decode\(z, normalized=True\)"):
            sae.decode(z)
        with pytest.raises(ValueError, match=r"stats: expected \(mu, std\) of shape "
                                             r"\(4, 6, 1\)"):
            sae.decode(z, stats=sae.input_stats(x[:2]))
        with pytest.raises(ValueError, match="not both"):
            sae.decode(z, stats=(m, s), normalized=True)
    plain = _sae("abstopk")
    with pytest.raises(ValueError, match="stats/normalized are for layer_norm SAEs"):
        plain.decode(torch.zeros(2, M, dtype=torch.float64), normalized=True)
    with pytest.raises(ValueError, match="only 'layer_norm' SAEs normalize"):
        plain.input_stats(x)
