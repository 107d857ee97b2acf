"""Activations at a named submodule of any torch.nn.Module (tensoralg.sae.hooks): the values
against the model's own layers called by hand, streaming in chunks, resuming, the metadata
record, and the errors (unknown hook names with the nearest names, NaN activations)."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from tensoralg.sae.hooks import (
    activations_at,
    collect_activations,
    get_submodule,
    read_activation_metadata,
    spliced,
)


class Counting(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), Counting(7), nn.Linear(7, 3)).double()


def _batches(n=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 6, 5, generator=g, dtype=torch.float64) for _ in range(n)]


def test_unknown_hook_name_lists_nearest_names():
    net = _net()
    with pytest.raises(ValueError, match=r"hook_name: '2\.lni' is not a submodule of "
                                         r"Sequential \(6 submodules\); nearest: \['2\.lin'"):
        get_submodule(net, "2.lni")
    with pytest.raises(ValueError, match=r"point: expected one of \['output', 'input'\]"):
        activations_at(net, "1", torch.zeros(1, 5, dtype=torch.float64), point="middle")
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module"):
        get_submodule(lambda x: x, "0")


def test_activation_values_and_early_stop():
    net = _net()
    x = _batches(1)[0]
    with torch.no_grad():
        h1 = torch.tanh(net[0](x))
        want_out = net[2].lin(h1)
    assert torch.equal(activations_at(net, "1", x), h1)
    assert torch.equal(activations_at(net, "2", x, point="input"), h1)
    assert torch.equal(activations_at(net, "2.lin", x), want_out)
    calls = net[2].calls
    activations_at(net, "1", x)                      # stops before block 2
    assert net[2].calls == calls
    activations_at(net, "1", x, stop=False)
    assert net[2].calls == calls + 1


def test_spliced_replaces_the_activation():
    net = _net()
    x = _batches(1)[0]
    with torch.no_grad():
        want = net[3](net[2](torch.zeros_like(torch.tanh(net[0](x)))))
        with spliced(net, "1", torch.zeros_like):
            got = net(x)
        assert torch.equal(got, want)
        with spliced(net, "2", torch.zeros_like, point="input"):
            assert torch.equal(net(x), want)
        assert not torch.equal(net(x), want)         # the hook is removed after the block
    with pytest.raises(ValueError, match="fn: must return a tensor of the activation's shape"), \
            spliced(net, "1", lambda a: a[:, :1]), torch.no_grad():
        net(x)


@pytest.mark.parametrize("chunk_rows", [1, 50, 10_000])
def test_collect_streams_the_same_rows_in_chunks(tmp_path, chunk_rows):
    net = _net()
    batches = _batches()
    with torch.no_grad():
        want = torch.cat([torch.tanh(net[0](b)).reshape(-1, 7) for b in batches]).float().numpy()
    info = collect_activations(net, "1", batches, tmp_path / "a.npy", chunk_rows=chunk_rows,
                               metadata={"model_name": "toy", "dataset_path": "randn"},
                               progress=False)
    got = np.load(tmp_path / "a.npy")
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert info["shape"] == [9 * 24, 7] and info["n_batches"] == 9
    side = json.loads((tmp_path / "a.npy.json").read_text())
    assert side["metadata"] == {"model_name": "toy", "dataset_path": "randn", "hook_name": "1"}
    assert read_activation_metadata(tmp_path / "a.npy")["model_name"] == "toy"
    assert not (tmp_path / "a.npy.partial").exists()


def test_collect_resumes_after_an_interruption(tmp_path):
    net = _net()
    batches = _batches()
    collect_activations(net, "2", batches, tmp_path / "full.npy", chunk_rows=40, point="input",
                        progress=False)

    def interrupted():
        for i, b in enumerate(batches):
            if i == 6:
                raise KeyboardInterrupt
            yield b

    with pytest.raises(KeyboardInterrupt):
        collect_activations(net, "2", interrupted(), tmp_path / "r.npy", chunk_rows=40,
                            point="input", progress=False)
    state = json.loads((tmp_path / "r.npy.partial" / "state.json").read_text())
    assert state["batches_done"] == 6 and not (tmp_path / "r.npy").exists()
    # a run of another hook does not reuse the interrupted one
    with pytest.raises(ValueError, match="holds an interrupted run of another hook"):
        collect_activations(net, "1", batches, tmp_path / "r.npy", chunk_rows=40,
                            progress=False)
    calls = net[2].calls
    collect_activations(net, "2", batches, tmp_path / "r.npy", chunk_rows=40, point="input",
                        progress=False)
    assert net[2].calls == calls      # the hook is block 2's input: the forward stops there
    assert np.array_equal(np.load(tmp_path / "r.npy"), np.load(tmp_path / "full.npy"))


def test_nan_activations_are_refused_before_writing(tmp_path):
    net = _net()
    batches = _batches(3)
    batches[1][2, 3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"activation at '1' of batch 1 has NaN or inf "
                                         r"\(row 15 of the batch\)"):
        collect_activations(net, "1", batches, tmp_path / "n.npy", progress=False)
    assert not (tmp_path / "n.npy").exists()
    with pytest.raises(ValueError, match=r"is not a submodule"):
        collect_activations(net, "blocks.1", batches, tmp_path / "m.npy", progress=False)
    assert not (tmp_path / "m.npy.partial").exists()


def test_training_records_the_activation_metadata(tmp_path):
    """sae train --data X.npy: X.npy.json's metadata goes into the SAE's cfg.json metadata."""
    from tensoralg.sae.formats import load_sae
    from tensoralg.sae.presets import make_config
    from tensoralg.sae.training import TrainConfig, train
    net = _net()
    collect_activations(net, "1", _batches(), tmp_path / "a.npy", progress=False,
                        metadata={"model_name": "toy"})
    meta = read_activation_metadata(tmp_path / "a.npy")
    train(str(tmp_path / "a.npy"), make_config("topk", 7, 8, 2), TrainConfig(steps=3,
          batch_size=16, progress=False), out=tmp_path / "sae", meta={"metadata": meta})
    saved = json.loads((tmp_path / "sae" / "cfg.json").read_text())["metadata"]
    assert saved["model_name"] == "toy" and saved["hook_name"] == "1"
    assert saved["dataset_path"] == str(tmp_path / "a.npy")
    assert load_sae(tmp_path / "sae").metadata == saved


def test_sae_train_cli_copies_the_metadata(tmp_path):
    from tensoralg.cli import main
    net = _net()
    collect_activations(net, "1", _batches(), tmp_path / "a.npy", progress=False,
                        metadata={"model_name": "toy", "context_size": 6})
    assert main(["sae", "train", "--data", str(tmp_path / "a.npy"), "--preset", "topk",
                 "--d-sae", "8", "--k", "2", "--steps", "3", "--batch-size", "16",
                 "--no-progress", "--out", str(tmp_path / "sae")]) == 0
    saved = json.loads((tmp_path / "sae" / "cfg.json").read_text())["metadata"]
    assert (saved["model_name"], saved["hook_name"], saved["context_size"]) == ("toy", "1", 6)
