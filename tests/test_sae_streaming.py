"""Training from a live model (tensoralg.sae.streaming): the buffer holds exactly the hook's
activations (against a forward pass with a hook registered by hand), a resumed run equals the
uninterrupted one bit for bit, memory stays at the buffer, interrupts leave nothing, and every bad
input is a one-line error (exit 2) before any work."""

import json
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from tensoralg.sae._seeds import stream_generator
from tensoralg.sae.presets import make_config
from tensoralg.sae.streaming import ActivationStream, load_tokens
from tensoralg.sae.training import TrainConfig, train

V, D, T = 40, 12, 6

MODEL_PY = textwrap.dedent('''
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.emb = nn.Embedding(40, 12)
            self.blocks = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])
            self.out = nn.Linear(12, 40)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            self.forwards = 0

        def forward(self, t):
            self.forwards += 1
            h = self.emb(t)
            for b in self.blocks:
                h = h + torch.tanh(b(h))
            return self.out(h)

    def make():
        return TinyLM()

    class Exploding(TinyLM):
        def forward(self, t):
            raise RuntimeError("this model must not be run")

    def exploding():
        return Exploding()

    def not_a_model():
        return 3
''')


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tinylm.py"
    path.write_text(MODEL_PY)
    return path


def _model(model_file):
    from tensoralg.sae.streaming import load_model_spec
    return load_model_spec(f"{model_file}:make")


def _tokens(n=120, seed=0):
    return np.random.default_rng(seed).integers(0, V, (n, T))


def test_buffer_equals_a_forward_pass_with_a_manual_hook(model_file):
    model = _model(model_file)
    toks = _tokens()
    stream = ActivationStream(model, "blocks.1", toks, buffer_size=200, seed=3, forward_batch=7)
    assert stream.rows == 198 and stream.seqs_per_refill == 33 and stream.d_in == D
    stream.set_batch_size(32)
    for r in (0, 1, 4):                        # 4 refills of 33 > 120 sequences: past an epoch
        # the sequences of refill r, from the stream's documented rule, recomputed here
        ids = []
        for p in range(r * 33, (r + 1) * 33):
            e, i = divmod(p, 120)
            ids.append(int(torch.randperm(120, generator=stream_generator(
                3, "stream_sequences", e))[i]))
        seen = []
        handle = model.blocks[1].register_forward_hook(lambda m, a, out, seen=seen: seen.append(out))
        with torch.no_grad():
            model(torch.as_tensor(toks[ids]))
        handle.remove()
        rows = seen[0].reshape(-1, D)
        perm = torch.randperm(198, generator=stream_generator(3, "stream_shuffle", r))
        assert torch.equal(stream.buffer(r), rows[perm])
    # a batch is a slice of its refill's buffer
    assert torch.equal(stream.batch(7), stream.buffer(1)[32:64])
    assert stream.batches_per_refill == 6


def _train(stream, steps, out, resume=None, ckpt_every=0):
    cfg = make_config("abstopk", D, 24, 3)
    tc = TrainConfig(steps=steps, batch_size=32, seed=5, log_every=5, ckpt_every=ckpt_every,
                     resample_every=10, resample_pool=64)
    return train(stream, cfg, tc, out=out, resume=resume)


def test_resumed_stream_run_is_bit_identical(model_file, tmp_path):
    toks = _tokens()

    def stream():
        return ActivationStream(_model(model_file), "blocks.0", toks, buffer_size=100, seed=5)

    full, hist_full = _train(stream(), 40, tmp_path / "full")
    # 3 batches per refill: step 17 is inside refill 5, recomputed from (seed, 5) on resume
    _train(stream(), 17, tmp_path / "part")
    resumed, hist = _train(stream(), 40, tmp_path / "part", resume=tmp_path / "part")
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # the same log record ("resampled" counts this call's resamplings: 1 before step 17, so the
    # resampling ran in both parts)
    assert hist_full[-1]["resampled"] == hist[-1]["resampled"] + 1
    assert hist[-1] == {**hist_full[-1], "seconds": hist[-1]["seconds"], "resampled": 0}
    cfg = json.loads((tmp_path / "part" / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name"] == "blocks.0"
    assert cfg["metadata"]["model_class_name"] == "TinyLM"
    assert cfg["streamed_buffer_rows"] == 96 and cfg["streamed_seed"] == 5
    # another stream is refused by the resume
    other = ActivationStream(_model(model_file), "blocks.0", toks, buffer_size=200, seed=5)
    with pytest.raises(ValueError, match=r"resume: .* another stream .*streamed_buffer_rows"):
        _train(other, 60, tmp_path / "part", resume=tmp_path / "part")


def test_memory_is_the_buffer(model_file):
    stream = ActivationStream(_model(model_file), "blocks.0", _tokens(300), buffer_size=60)
    stream.set_batch_size(20)
    first = stream.buffer(0)
    ptr = first.data_ptr()
    for step in range(0, 90):
        stream.batch(step)
    # 90 steps = 30 refills through one preallocated (rows, d_in) tensor
    assert stream.refills_computed == 30
    assert stream._buf.data_ptr() == ptr and tuple(stream._buf.shape) == (60, D)
    assert stream.buffer_bytes == 60 * D * 4


def test_interrupt_leaves_nothing(model_file, tmp_path):
    class Interrupting(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _model(model_file)
            self.calls = 0

        def forward(self, t):
            self.calls += 1
            if self.calls > 4:
                raise KeyboardInterrupt
            return self.inner(t)

    stream = ActivationStream(Interrupting(), "inner.blocks.0", _tokens(), buffer_size=60)
    with pytest.raises(KeyboardInterrupt):
        _train(stream, 40, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _cli(capsys, *args):
    """``tensoralg sae train ARGS`` in this process: (exit code, stderr)."""
    from tensoralg.cli import main

    capsys.readouterr()
    rc = main(["sae", "train", "--threads", "1", *map(str, args)])
    return SimpleNamespace(returncode=rc, stderr=capsys.readouterr().err)


def test_cli_trains_from_a_model_and_resumes(model_file, tmp_path, capsys):
    np.save(tmp_path / "toks.npy", _tokens())
    common = ["--model", f"{model_file}:make", "--hook", "blocks.1", "--tokens",
              tmp_path / "toks.npy", "--d-sae", 24, "--k", 3, "--preset", "abstopk",
              "--batch-size", 32, "--buffer-size", 100, "--no-progress"]
    r = _cli(capsys, *common, "--steps", 20, "--out", tmp_path / "full")
    assert r.returncode == 0, r.stderr
    r = _cli(capsys, *common, "--steps", 8, "--out", tmp_path / "part")
    assert r.returncode == 0, r.stderr
    r = _cli(capsys, "--resume", tmp_path / "part", "--out", tmp_path / "part", "--steps", 20,
             "--no-progress")    # the model, hook and tokens are the run's
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    a = load_file(tmp_path / "full" / "sae_weights.safetensors")
    b = load_file(tmp_path / "part" / "sae_weights.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "full" / "cfg.json").read_text())
    assert cfg["metadata"]["model_name"] == f"{model_file}:make"
    assert cfg["metadata"]["dataset_path"] == str(tmp_path / "toks.npy")
    r = _cli(capsys, "--resume", tmp_path / "part", "--out", tmp_path / "part", "--steps", 30,
             "--hook", "blocks.0")
    assert r.returncode == 2
    assert "--hook: blocks.0 differs from the resumed run's blocks.1" in r.stderr


@pytest.mark.parametrize("extra, tokens, message", [
    (["--hook", "block.1"], "ok", r"--hook: 'block.1' is not a submodule of TinyLM .*nearest: "
                                  r"\['blocks.1'.*all: \['emb', 'blocks', 'blocks.0', "
                                  r"'blocks.1', 'out'\]"),
    (["--model", "{file}:nope"], "ok", r"--model: .* has no callable 'nope'; its public "
                                       r"callables: .*'make'"),
    (["--model", "no_such_module_xyz:make"], "ok", r"--model: cannot import 'no_such_module_xyz'"),
    (["--model", "{file}:not_a_model"], "ok", r"--model: .*not_a_model\(\) returned a int"),
    (["--model", "{file}"], "ok", r"--model: expected MODULE:FACTORY"),
    ([], "missing", r"--tokens: .*missing.npy: no such file"),
    ([], "float", r"--tokens: .* has dtype float64; expected integer token ids"),
    ([], "3d", r"--tokens: .* has shape \(2, 3, 6\)"),
    ([], "range", r"--tokens: .* has token id 40 at sequence 5, position 2; expected "
                  r"\[0, 40\) \(the model's vocabulary\)"),
    ([], "1d", r"--tokens: .* is a 1-D token stream of 30 ids; give a context size"),
    (["--d-in", 13], "ok", r"--d-in: 13, but the output of 'blocks.1' in .* has width 12"),
    (["--buffer-size", 40], "ok", r"--batch-size: 64 exceeds the buffer of 36 rows"),
    (["--buffer-size", 4], "ok", r"--buffer-size: 4 rows hold no full sequence of "
                                 r"context_size=6"),
    (["--hook", None], "ok", r"--hook: required with --model"),
])
def test_cli_bad_inputs(model_file, tmp_path, extra, tokens, message, capsys):
    good = _tokens()
    files = {"ok": good, "float": good.astype(float), "3d": good[:6].reshape(2, 3, 6),
             "1d": good.reshape(-1)[:30]}
    bad = good.copy()
    bad[5, 2] = V
    files["range"] = bad
    if tokens in files:
        np.save(tmp_path / f"{tokens}.npy", files[tokens])
    args = {"--model": f"{model_file}:make", "--hook": "blocks.1",
            "--tokens": tmp_path / f"{tokens}.npy"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        args[flag] = value.format(file=model_file) if isinstance(value, str) else value
    argv = [x for flag, value in args.items() if value is not None for x in (flag, value)]
    r = _cli(capsys, *argv, "--d-sae", 24, "--k", 3, "--batch-size", 64, "--out", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tensoralg sae train: error: "), r.stderr
    import re
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_bad_hook_is_refused_before_any_forward_pass(model_file, tmp_path, capsys):
    np.save(tmp_path / "toks.npy", _tokens())
    r = _cli(capsys, "--model", f"{model_file}:exploding", "--hook", "blocks.7", "--tokens",
             tmp_path / "toks.npy", "--d-sae", 24, "--k", 3, "--out", tmp_path / "out")
    assert r.returncode == 2
    assert "--hook: 'blocks.7' is not a submodule" in r.stderr
    assert "must not be run" not in r.stderr


def test_load_tokens_cuts_a_stream(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(20, dtype=np.int32))
    arr = load_tokens(tmp_path / "t.npy", context_size=6, vocab_size=20)
    assert arr.shape == (3, 6) and int(arr[2, 5]) == 17


def test_transformer_checkpoint_streams_the_corpus_by_default(tmp_path, capsys):
    from tensoralg.checkpoint import save_checkpoint
    from tensoralg.corpus import VOCAB
    from tensoralg.transformer import BilinearTransformer

    model = BilinearTransformer(len(VOCAB), 8, 1, 2, 4, None, n_ctx=8, seed=1)
    save_checkpoint(tmp_path / "ckpt", model)
    r = _cli(capsys, "--model", tmp_path / "ckpt", "--hook", "hook_resid.1", "--d-sae", 16, "--k", 2,
             "--steps", 4, "--batch-size", 64, "--buffer-size", 256, "--no-progress",
             "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "out" / "cfg.json").read_text())
    assert cfg["metadata"]["dataset_path"].startswith("tensoralg.corpus train split")
    assert cfg["metadata"]["context_size"] == 8 and cfg["d_in"] == 8
    assert cfg["streamed_hook_name"] == "hook_resid.1"


@pytest.mark.parametrize("flag, value", [("--hook", "blocks.0"), ("--buffer-size", "512"),
                                         ("--hook-point", "input"), ("--tokens", "t.npy")])
def test_stream_flags_without_model_are_refused(capsys, tmp_path, flag, value):
    r = _cli(capsys, "--synthetic", "6,8,2,128", "--steps", 2, flag, value,
             "--out", tmp_path / "out")
    assert r.returncode == 2
    assert f"{flag}: only with --model (it sets the streamed source)" in r.stderr

