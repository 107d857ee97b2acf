"""`sae bench` states what aRIP does in the multi-step preset, from the run's own numbers:
isae-me against isae-me-dl (the same encoder without aRIP; the bench applies no schedule)."""

from tensoralg.sae.bench import _findings, format_table


def _preset(fvu, iou, omp_iou):
    return {"fvu": fvu, "code_iou": iou, "omp": {"code_iou": omp_iou}, "plateau_change": None}


def _result(with_arip, without_arip):
    return {"isae-me": _preset(*with_arip), "isae-me-dl": _preset(*without_arip),
            "config": {"presets": []}}


def test_arip_finding_compares_with_and_without():
    worse = _findings(_result((0.05, 0.80, 0.90), (0.04, 0.85, 0.95)))["arip_in_isae_me"]
    assert worse["holds"] is False
    assert worse["with_arip"] == {"code_iou": 0.80, "omp_code_iou": 0.90, "fvu": 0.05}
    assert worse["without_arip"] == {"code_iou": 0.85, "omp_code_iou": 0.95, "fvu": 0.04}
    better = _findings(_result((0.04, 0.9, 0.96), (0.05, 0.8, 0.95)))["arip_in_isae_me"]
    assert better["holds"] is True
    r = _result((0.05, 0.80, 0.90), (0.04, 0.85, 0.95))
    r["findings"] = _findings(r)
    assert ("- aRIP helps the multi-step preset (isae-me vs the same encoder without aRIP, "
            "isae-me-dl untouched by its schedule here: cross-seed code IoU, code IoU of OMP on "
            "the learned dictionaries, FVU; values with, without): does NOT hold here "
            "(arip_in_isae_me = 0.800, 0.850, 0.900, 0.950, 0.050, 0.040)") in format_table(r)


def test_no_arip_finding_without_both_presets():
    r = {"isae-me": _preset(0.05, 0.8, 0.9), "config": {"presets": []}}
    assert "arip_in_isae_me" not in _findings(r)
