"""Blocked, resumable, distributed Gram / similarity matrices (tensoralg.blocks, docs/mathematics.md §6).

The reference everywhere is the single-process engine: ``ta.similarity_matrix`` / ``ta.gram``
on all models at once, and for a few entries the per-pair ``ta.inner`` (one contraction per
pair, no stacking). Blocking only regroups the same batched contractions, so the agreement
bound is float64 rounding: 1e-12 relative to the scale of each entry, ``||f_i|| ||f_j||``
(Cauchy-Schwarz bounds ``|G_ij|`` by it; a similarity is already divided by it). Rounding in a
sum of terms of that size is ``eps ||f_i|| ||f_j||`` whatever the summation order, so a
near-orthogonal pair (``|S_ij|`` of 1e-7, as among 128 random checkpoints) carries a larger
*elementwise* relative difference — between the engine and ``ta.inner`` just as much; the
observed gap here is ~1e-17 of the scale.
"""

import hashlib
import io
import json
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensoralg as ta
from tensoralg import blocks
from tensoralg.checkpoint import load_network, save_checkpoint
from tensoralg.cli import main
from tensoralg.nn import BilinearNet

N_CKPT = 7


def _model(seed, **kw):
    sizes = dict(d_model=6, d_hidden=8, residual=True, bias=True) | kw
    return BilinearNet(16, 5, seed=seed, **sizes)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    paths = []
    for i in range(N_CKPT):
        p = root / f"c{i}"
        save_checkpoint(p, _model(i), step=10 * i)
        paths.append(str(p))
    nets = [load_network(p) for p in paths]
    return paths, nets, np.asarray(ta.similarity_matrix(nets)), np.asarray(ta.gram(nets))


def _rel(a, b):
    """Largest difference relative to each entry's scale ``sqrt(|b_ii b_jj|)`` (1 for a
    similarity matrix, ``||f_i|| ||f_j||`` for a Gram matrix), per output for ``(N, N, K)``."""
    d = np.sqrt(np.abs(np.einsum("ii...->i...", b)))
    return float(np.max(np.abs(a - b) / np.einsum("i...,j...->ij...", d, d)))


def test_blocked_equals_single_process(ckpts, tmp_path):
    paths, nets, S_ref, G_ref = ckpts
    # block size 3 over 7 checkpoints: uneven last block, diagonal and off-diagonal blocks
    G, summary = blocks.gram(paths, tmp_path / "store", block_size=3, return_summary=True)
    assert summary["blocks"] == 6 and summary["computed_blocks"] == 6
    assert summary["devices"] == {"cpu": 6}
    assert _rel(G, G_ref) < 1e-12
    # an independent path for a few entries: one contraction per pair, nothing stacked
    for i, j in [(0, 6), (2, 3), (5, 5)]:
        assert G[i, j] == pytest.approx(ta.inner(nets[i], nets[j]), rel=1e-12)
    S = blocks.similarity_matrix(paths, tmp_path / "store", block_size=3)
    assert _rel(S, S_ref) < 1e-12
    assert np.array_equal(S, S.T) and np.all(np.diag(S) == 1.0)


@pytest.mark.parametrize("output", [3, "each"])
def test_blocked_slices_and_models_in_memory(ckpts, output):
    _, nets, _, _ = ckpts
    S = blocks.similarity_matrix(nets, block_size=2, output=output)
    ref = np.asarray(ta.similarity_matrix(nets, output=output))
    assert S.shape == ref.shape and _rel(S, ref) < 1e-12


def test_blocked_monte_carlo_and_closure_match_unblocked(ckpts):
    # Monte Carlo: every block draws the same seed's samples, so the blocked estimate is the
    # unblocked estimate (not merely close to it); closure is deterministic
    _, nets, _, _ = ckpts
    for kw in ({"method": "montecarlo", "n_samples": 3000, "seed": 4}, {"method": "closure"}):
        ref = np.asarray(ta.similarity_matrix(nets, **kw))
        assert _rel(blocks.similarity_matrix(nets, block_size=3, **kw), ref) < 1e-12


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), b=st.integers(1, 7))
def test_blocking_is_invisible(ckpts, n, b):
    _, nets, _, G_ref = ckpts
    assert _rel(blocks.gram(nets[:n], block_size=b), G_ref[:n, :n]) < 1e-12


def _block_files(store):
    return sorted(p.name for p in store.glob("G_*.npy"))


def test_interrupt_keeps_a_consistent_store_and_resume_finishes(ckpts, tmp_path):
    paths, _, S_ref, _ = ckpts
    store = tmp_path / "store"
    seen = []

    def stop_after_two(done, total):
        seen.append(done)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        blocks.similarity_matrix(paths, store, block_size=2, on_block=stop_after_two)
    files = _block_files(store)
    assert len(files) == 2 and seen == [1, 2]
    assert sorted(os.listdir(store)) == sorted(files + ["manifest.json"])  # no temp files
    stamps = {f: (store / f).stat().st_mtime_ns for f in files}
    for f in files:
        np.load(store / f, allow_pickle=False)  # complete .npy files
    seen.clear()
    S, summary = blocks.similarity_matrix(paths, store, block_size=2, on_block=lambda d, t:
                                          seen.append((d, t)), return_summary=True)
    # 4 row blocks -> 10 blocks; 2 resumed, 8 computed, the finished ones untouched
    assert summary["resumed_blocks"] == 2 and summary["computed_blocks"] == 8
    assert seen[0] == (3, 10) and seen[-1] == (10, 10)
    assert {f: (store / f).stat().st_mtime_ns for f in files} == stamps
    assert _rel(S, S_ref) < 1e-12
    # all done: resuming computes nothing
    _, summary = blocks.similarity_matrix(paths, store, block_size=2, return_summary=True)
    assert summary["computed_blocks"] == 0 and summary["resumed_blocks"] == 10


def test_resume_refuses_a_store_of_other_checkpoints_or_options(ckpts, tmp_path):
    paths, _, _, _ = ckpts
    store = tmp_path / "store"
    blocks.gram(paths[:4], store, block_size=2)
    with pytest.raises(ValueError, match="resume=True"):
        blocks.gram(paths[:4], store, block_size=2, resume=False)
    with pytest.raises(ValueError, match="block_size was 2, now 3"):
        blocks.gram(paths[:4], store, block_size=3)
    with pytest.raises(ValueError, match="method was 'exact', now 'closure'"):
        blocks.gram(paths[:4], store, block_size=2, method="closure")
    # same count, one checkpoint replaced by another: refused by content, naming it
    swapped = paths[:3] + [paths[5]]
    with pytest.raises(ValueError, match=r"checkpoint #3 \(.*c5\) differs in content"):
        blocks.gram(swapped, store, block_size=2)
    # the same path rewritten with other weights is caught by its hash, not its name
    copy = tmp_path / "copy"
    save_checkpoint(copy, _model(0), step=0)
    blocks.gram([str(copy), paths[1]], tmp_path / "s2", block_size=1)
    save_checkpoint(copy, _model(99), step=0)
    with pytest.raises(ValueError, match=r"checkpoint #0 .* differs in content"):
        blocks.gram([str(copy), paths[1]], tmp_path / "s2", block_size=1)
    # a folder that is not a store
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="not a block store"):
        blocks.gram(paths[:2], tmp_path / "busy")


def test_resume_refuses_a_block_file_changed_after_it_was_written(ckpts, tmp_path):
    paths, _, S_ref, _ = ckpts
    store = tmp_path / "store"
    blocks.similarity_matrix(paths[:4], store, block_size=2)
    files = _block_files(store)
    assert len(files) == 3
    # every block file is named by the SHA-256 of its bytes
    for f in files:
        assert f.split("_")[3][:-4] == hashlib.sha256((store / f).read_bytes()).hexdigest()[:16]
    # a valid .npy with one entry changed: still loadable, so only the hash can catch it
    victim = store / files[1]
    arr = np.load(victim)
    arr[0, 0] += 1.0
    buf = io.BytesIO()
    np.save(buf, arr)
    victim.write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match=rf"{files[1]}: the file's SHA-256 starts .* changed "
                                         rf"after it was written"):
        blocks.similarity_matrix(paths[:4], store, block_size=2)
    victim.unlink()                     # as the message says: delete it and resume
    S = blocks.similarity_matrix(paths[:4], store, block_size=2)
    assert _rel(S, S_ref[:4, :4]) < 1e-12
    # two files for one block (e.g. copied in by hand) are refused, naming both
    extra = store / (files[0][:-20] + "0" * 16 + ".npy")
    extra.write_bytes((store / files[0]).read_bytes())
    with pytest.raises(ValueError, match=r"2 files for block \(0, 0\)"):
        blocks.similarity_matrix(paths[:4], store, block_size=2)


def _corrupt_variants(good, tmp_path):
    """(folder, expected message) pairs, each a copy of ``good`` broken one way."""
    import shutil

    out = []

    def clone(name):
        dst = tmp_path / name
        shutil.copytree(good, dst)
        return dst

    d = clone("truncated")
    w = d / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:-40])
    out.append((d, "truncated"))
    d = clone("garbage")
    (d / "weights.safetensors").write_bytes(b"\xff" * 64)
    out.append((d, "corrupt or truncated safetensors"))
    d = clone("badjson")
    (d / "cfg.json").write_text("{not json")
    out.append((d, "corrupt JSON"))
    d = clone("shape")
    cfg = json.loads((d / "cfg.json").read_text())
    cfg["d_hidden"] = 9
    (d / "cfg.json").write_text(json.dumps(cfg))
    out.append((d, "has shape"))
    d = clone("missing")
    (d / "weights.safetensors").unlink()
    out.append((d, "missing"))
    return out


def test_corrupt_checkpoint_fails_naming_it_before_any_block(ckpts, tmp_path):
    paths, _, _, _ = ckpts
    calls = []
    for bad, msg in _corrupt_variants(paths[0], tmp_path):
        with pytest.raises((ValueError, FileNotFoundError), match=msg) as err:
            blocks.gram(paths[:5] + [str(bad)], tmp_path / f"store-{bad.name}", block_size=2,
                        on_block=lambda d, t: calls.append(d))
        assert str(bad) in str(err.value)
        assert not (tmp_path / f"store-{bad.name}").exists()
    assert calls == []
    other = tmp_path / "other"
    save_checkpoint(other, _model(1, d_hidden=10))
    with pytest.raises(ValueError, match=r"different architecture .*d_hidden: 8 vs 10"):
        blocks.gram([paths[0], str(other)])


def test_bad_arguments_are_named():
    nets = [_model(0).to_network(), _model(1).to_network()]
    for kw, msg in [({"block_size": 0}, "block_size"), ({"workers": 0}, "workers"),
                    ({"client": object(), "workers": 2}, "give one"),
                    ({"device": "tpu"}, "device"), ({"retries": -1}, "retries"),
                    ({"threads": 0}, "threads"), ({"method": "magic"}, "method")]:
        with pytest.raises(ValueError, match=msg):
            blocks.gram(nets, **kw)
    with pytest.raises(TypeError, match="single one"):
        blocks.gram("some/ckpt")
    with pytest.raises(ValueError, match="empty"):
        blocks.gram([])
    with pytest.raises(TypeError, match="mix"):
        blocks.gram(["a", nets[0]])
    with pytest.raises(ValueError, match=r"sources\[1\]: maps 16 -> 3"):
        blocks.gram([nets[0], BilinearNet(16, 3, d_model=4, d_hidden=4)])


# ----------------------------------------------------------------------------------------
# Dask: one LocalCluster of 2 worker processes for the module
# ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def forked_workers():
    """Worker processes forked from this one (they start with tensoralg and torch already
    imported: a cold spawn costs ~10 s per worker on the loaded 2-core CI machine). Still real,
    separate processes: the kill test kills one with SIGKILL. Production keeps Dask's default
    (spawn)."""
    import dask
    import distributed  # noqa: F401  the test extra installs dask[distributed]; missing fails here

    with dask.config.set({"distributed.worker.multiprocessing-method": "fork"}):
        yield


@pytest.fixture(scope="module")
def client(forked_workers):
    import distributed

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as c:
        yield c


def test_dask_client_equals_single_process(ckpts, client, tmp_path):
    paths, _, S_ref, _ = ckpts
    S, summary = blocks.similarity_matrix(paths, tmp_path / "store", block_size=2,
                                          client=client, return_summary=True)
    assert _rel(S, S_ref) < 1e-12
    assert summary["devices"] == {"cpu": 10}
    assert len(_block_files(tmp_path / "store")) == 10


def test_killed_worker_loses_only_its_block(client, tmp_path):
    # enough small blocks that both workers hold tasks when the first result arrives
    nets = [_model(i).to_network() for i in range(10)]
    ref = np.asarray(ta.similarity_matrix(nets))
    killed = {}

    def kill_a_busy_worker(done, total):
        if killed:
            return
        busy = {w: keys for w, keys in client.processing().items() if keys}
        if not busy:
            return  # try again after the next block
        victim = sorted(busy)[0]
        pid = client.run(os.getpid, workers=[victim])[victim]
        killed.update(worker=victim, pid=pid, tasks=len(busy[victim]))
        os.kill(pid, signal.SIGKILL)

    S, summary = blocks.similarity_matrix(nets, tmp_path / "store", block_size=1, client=client,
                                          on_block=kill_a_busy_worker, return_summary=True)
    assert killed and killed["tasks"] >= 1  # a worker died while it held work
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)
    assert summary["computed_blocks"] == 55 and len(_block_files(tmp_path / "store")) == 55
    assert _rel(S, ref) < 1e-12
    client.wait_for_workers(2, timeout=60)  # the nanny restarts it for the next tests


def test_cli_blocked_resume_and_scheduler(ckpts, client, tmp_path, capsys):
    paths, _, S_ref, _ = ckpts
    out = tmp_path / "m"
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "3",
                 "--scheduler", client.scheduler.address]) == 0
    text = capsys.readouterr().out
    assert "6 blocks" in text and "6 computed" in text
    res = json.loads((out / "matrix.json").read_text())
    assert _rel(np.array(res["similarity_matrix"]), S_ref) < 1e-12
    assert _rel(np.load(out / "matrix.npy"), S_ref) < 1e-12
    assert res["blocks"]["devices"] == {"cpu": 6} and res["method"] == "exact"
    for f in ("matrix.csv", "matrix.png", "blocks/manifest.json"):
        assert (out / f).stat().st_size > 0
    # an existing store needs --resume; with it, nothing is recomputed
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "3"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "3", "--resume"]) == 0
    assert "6 resumed, 0 computed" in capsys.readouterr().out


def test_cli_interrupt_then_resume(ckpts, tmp_path, capsys, monkeypatch):
    paths, _, S_ref, _ = ckpts
    out = tmp_path / "m"
    real, calls = blocks._block_task, []

    def interrupted_on_third(*a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(blocks, "_block_task", interrupted_on_third)
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "2"]) == 130
    err = capsys.readouterr().err
    assert "2 finished blocks are kept" in err and "--resume" in err
    assert not (out / "matrix.json").exists() and len(_block_files(out / "blocks")) == 2
    monkeypatch.setattr(blocks, "_block_task", real)
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "2", "--resume"]) == 0
    assert "2 resumed, 8 computed" in capsys.readouterr().out
    assert _rel(np.load(out / "matrix.npy"), S_ref) < 1e-12


def test_cli_errors(ckpts, tmp_path, capsys):
    paths, _, _, _ = ckpts
    bad, msg = _corrupt_variants(paths[0], tmp_path)[0]
    assert main(["matrix", *paths, str(bad), "--out", str(tmp_path / "m"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and msg in err and not (tmp_path / "m").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main(["matrix", *paths, "--out", str(tmp_path / "busy"), "--block-size", "2"]) == 2
    assert "not a blocked matrix run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["matrix", *paths, "--workers", "2", "--scheduler", "tcp://x:1"])
    with pytest.raises(SystemExit):
        main(["matrix", *paths, "--block-size", "0"])


def test_cli_local_workers(ckpts, tmp_path, capsys):
    # --workers 2 starts (and closes) its own LocalCluster of 2 processes, spawned as in
    # production: forking them from this process while the module's other cluster runs its
    # event-loop threads hung the cluster's start once (a fork of a threaded process)
    import dask

    paths, _, S_ref, _ = ckpts
    t = time.perf_counter()
    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        assert main(["matrix", *paths[:4], "--out", str(tmp_path / "m"), "--workers", "2",
                     "--block-size", "2"]) == 0
    assert time.perf_counter() - t < 120
    assert "3 computed" in capsys.readouterr().out
    assert _rel(np.load(tmp_path / "m" / "matrix.npy"), S_ref[:4, :4]) < 1e-12


def test_ta_gram_and_similarity_matrix_route_to_the_block_store(tmp_path):
    """ta.gram / ta.similarity_matrix with out= run the blocked path and agree with the
    in-memory result to 1e-12 of each entry's scale."""
    import tensoralg as ta
    from tensoralg.nn import BilinearNet

    models = [BilinearNet(5, 3, d_model=3, d_hidden=4, seed=s) for s in range(5)]
    G = ta.gram(models)
    Gb = ta.gram(models, out=tmp_path / "store", block_size=2)
    dg = np.sqrt(np.diag(G))
    assert np.all(np.abs(Gb - G) <= 1e-12 * np.outer(dg, dg))
    assert (tmp_path / "store").exists()
    S = ta.similarity_matrix(models, out=tmp_path / "s2", block_size=3)
    assert np.all(np.abs(S - ta.similarity_matrix(models)) <= 1e-12)
    with pytest.raises(ValueError, match="blocked path computes in floating point"):
        ta.gram(models, backend="exact", out=tmp_path / "x")


# ----------------------------------------------------------------------------------------
# bilinear-transformer checkpoints (sequence models) in blocks
# ----------------------------------------------------------------------------------------

def _transformer(seed, n_layers=1, vocab=7, n_ctx=3, **kw):
    from tensoralg.transformer import BilinearTransformer

    return BilinearTransformer(vocab, 4, n_layers, 2, 2, n_ctx=n_ctx, rope=100.0, seed=seed,
                               dtype="float64", **kw)


@pytest.fixture(scope="module")
def lm_ckpts(tmp_path_factory):
    """Five one-layer and four two-layer tiny transformers; one of each trained with a longer
    context (4) than the others (3), so the default n_ctx is the shortest, 3."""
    root = tmp_path_factory.mktemp("lm")
    out = {}
    for depth, count in ((1, 5), (2, 4)):
        paths = []
        for i in range(count):
            p = root / f"L{depth}_{i}"
            save_checkpoint(p, _transformer(10 * depth + i, depth, n_ctx=4 if i == 1 else 3),
                            step=i)
            paths.append(str(p))
        out[depth] = paths
    return out


def _lm_nets(paths, n_ctx=3):
    from tensoralg.checkpoint import load_checkpoint

    return [load_checkpoint(p)[0].to_network(n_ctx=n_ctx) for p in paths]


@pytest.mark.parametrize("depth, method", [(1, "exact"), (2, "closure")])
def test_blocked_transformer_matrix_equals_unblocked(lm_ckpts, tmp_path, depth, method):
    """`tensoralg matrix` with blocks = without (1e-12; the blocks call the same attention
    functions, so the entries agree to rounding), --method auto choosing as unblocked (exact at
    one layer; refused at two, so the closure is asked for there: issue 21 made it no default);
    and a few Gram entries against the per-pair functions (one call per pair, nothing shared)."""
    from tensoralg.audit.compare import run_matrix
    from tensoralg.audit.matrix_blocks import run_matrix_blocked
    from tensoralg.strategies import closure, sequence_exact

    paths = lm_ckpts[depth]
    kw = {} if depth == 1 else {"method": "closure"}
    if depth == 2:
        for fn, extra in ((run_matrix, {}), (run_matrix_blocked, {"block_size": 2})):
            with pytest.raises(ValueError, match="--method auto: the exact similarity of "
                                                 "depth-2 bilinear transformers is out of reach"):
                fn(paths, tmp_path / "refused", **extra)
        assert not (tmp_path / "refused").exists()
    ref = run_matrix(paths, tmp_path / "flat", **kw)
    got = run_matrix_blocked(paths, tmp_path / "blocked", block_size=2, **kw)
    assert ref["method"] == got["method"] == method and got["n_ctx"] == 3
    S_ref, S = np.array(ref["similarity_matrix"]), np.load(tmp_path / "blocked" / "matrix.npy")
    assert S.shape == (len(paths),) * 2 and np.max(np.abs(S - S_ref)) <= 1e-12
    assert np.all(np.diag(S) == 1.0) and np.array_equal(S, S.T)
    G = blocks.gram(paths, block_size=2, method=method)
    nets = _lm_nets(paths)
    pair = sequence_exact.exact_inner if method == "exact" else closure.closure_inner
    for i, j in [(0, len(paths) - 1), (1, 2), (2, 2)]:
        assert G[i, j] == pytest.approx(pair(nets[i], nets[j], n_ctx=3), rel=1e-12)


def test_blocked_transformer_models_in_memory_and_n_ctx(lm_ckpts):
    from tensoralg.strategies import sequence_exact

    nets = _lm_nets(lm_ckpts[1], n_ctx=2)
    ref = sequence_exact.exact_gram(nets, n_ctx=2)
    assert _rel(blocks.gram(nets, block_size=3, n_ctx=2), ref) < 1e-12
    assert _rel(blocks.gram(lm_ckpts[1], block_size=3, n_ctx=2), ref) < 1e-12
    ref1 = sequence_exact.exact_gram(nets, n_ctx=2, output=1)
    assert _rel(blocks.gram(nets, block_size=2, n_ctx=2, output=1), ref1) < 1e-12


def test_blocked_transformer_store_round_trip(lm_ckpts, tmp_path, capsys):
    paths = lm_ckpts[1]
    store = tmp_path / "store"
    G, summary = blocks.gram(paths, store, block_size=2, return_summary=True)
    assert summary["computed_blocks"] == 6 and summary["n_ctx"] == 3
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["n_ctx"] == 3 and manifest["method"] == "exact"
    assert [c["n_ctx_trained"] for c in manifest["checkpoints"]] == [3, 4, 3, 3, 3]
    # every stored block reads back (hash checked) as the matching part of G
    st = blocks.BlockStore(store, manifest, resume=True)
    for I, J in st.finished():
        rows, cols = slice(2 * I, min(5, 2 * I + 2)), slice(2 * J, min(5, 2 * J + 2))
        np.testing.assert_array_equal(st.read(I, J, G[rows, cols].shape), G[rows, cols])
    G2, summary = blocks.gram(paths, store, block_size=2, return_summary=True)
    assert summary["computed_blocks"] == 0 and summary["resumed_blocks"] == 6
    np.testing.assert_array_equal(G2, G)
    with pytest.raises(ValueError, match="n_ctx was 3, now 2"):
        blocks.gram(paths, store, block_size=2, n_ctx=2)
    # through the CLI, with --n-ctx, then resumed
    out = tmp_path / "m"
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "2", "--n-ctx", "2"]) == 0
    assert "6 computed" in capsys.readouterr().out
    res = json.loads((out / "matrix.json").read_text())
    assert res["n_ctx"] == 2 and res["method"] == "exact"
    from tensoralg.strategies import sequence_exact

    S_ref = sequence_exact.exact_gram(_lm_nets(paths, n_ctx=2), n_ctx=2, similarity=True)
    assert np.max(np.abs(np.load(out / "matrix.npy") - S_ref)) <= 1e-12
    assert main(["matrix", *paths, "--out", str(out), "--block-size", "2", "--n-ctx", "2",
                 "--resume"]) == 0
    assert "6 resumed, 0 computed" in capsys.readouterr().out


def test_blocked_transformer_bad_input_before_any_block(lm_ckpts, tmp_path, capsys):
    from tensoralg.audit.matrix_blocks import run_matrix_blocked

    one, two = lm_ckpts[1], lm_ckpts[2]
    other = tmp_path / "vocab8"
    save_checkpoint(other, _transformer(0, vocab=8))
    clf = tmp_path / "clf"
    save_checkpoint(clf, _model(0))
    calls = []
    cases = [
        (dict(sources=one + [str(other)]), ValueError,
         rf"vocabularies differ \({one[0]}: vocab 7, {other}: vocab 8\)"),
        (dict(sources=one, n_ctx=4), ValueError,
         rf"n_ctx=4: beyond the trained context n_ctx=3 of {one[0]}; use at most 3"),
        (dict(sources=one + [str(clf)]), ValueError, r"a matrix compares checkpoints of one kind"),
        (dict(sources=one, method="montecarlo"), ValueError, r"'exact' .* or 'closure'"),
        (dict(sources=one, output="each"), ValueError, r"output: 'each' is not supported"),
        (dict(sources=two, method="exact"), ta.CostTooHigh, r"method='closure'"),
        (dict(sources=[str(clf), str(clf)], n_ctx=2), ValueError, r"n_ctx: only for sequence"),
    ]
    for k, (kw, exc, msg) in enumerate(cases):
        with pytest.raises(exc, match=msg):
            blocks.gram(kw.pop("sources"), tmp_path / f"s{k}", block_size=2,
                        on_block=lambda d, t: calls.append(d), **kw)
        assert not (tmp_path / f"s{k}").exists()
    assert calls == []
    # the CLI: errors named, exit 2, nothing written
    for extra, msg in ([["--n-ctx", "4"], "beyond the trained context n_ctx=3"],
                       [["--output", "1"], "--output: not supported for bilinear-transformer"],
                       [["--method", "montecarlo"], "--method montecarlo: the blocked path"]):
        assert main(["matrix", *one, "--out", str(tmp_path / "c"), "--block-size", "2",
                     *extra]) == 2
        assert msg in capsys.readouterr().err
        assert not (tmp_path / "c" / "blocks").exists()
    with pytest.raises(ValueError, match="vocabularies differ"):
        run_matrix_blocked(one + [str(other)], tmp_path / "r", block_size=2)
    with pytest.raises(ValueError, match="--n-ctx: only for bilinear-transformer"):
        run_matrix_blocked([str(clf), str(clf)], tmp_path / "r", block_size=2, n_ctx=2)


def test_blocked_transformer_on_dask(lm_ckpts, tmp_path):
    """The Dask path: an in-process cluster (no worker processes to spawn, which can stall on a
    loaded machine) run from a daemon thread with a deadline, so a hang fails instead of
    blocking the suite; the block tasks also survive a pickle round trip, as a cluster of
    processes needs."""
    import pickle
    import threading

    distributed = pytest.importorskip("distributed")
    paths = lm_ckpts[2]
    ref = blocks.gram(paths, block_size=4, method="closure")   # one block: the unblocked path
    task = pickle.loads(pickle.dumps((blocks._block_task, [paths[0]], [paths[3]],
                                      {**blocks._options("gaussian", "closure", None, "cpu", 2,
                                                         0, 1, None, None, 3),
                                       "sequence": True})))
    block, device = task[0](*task[1:])
    assert device == "cpu" and block.shape == (1, 1)
    assert abs(block[0, 0] - ref[0, 3]) <= 1e-12 * np.sqrt(ref[0, 0] * ref[3, 3])
    result = {}

    def run():
        try:
            with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                                    dashboard_address=":0") as c:
                result["G"] = blocks.gram(paths, tmp_path / "store", block_size=2, client=c,
                                          method="closure", return_summary=True)
        except BaseException as exc:  # reported below
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=180)
    assert not t.is_alive(), "the Dask run did not finish within 180 s"
    assert "error" not in result, result.get("error")
    G, summary = result["G"]
    assert summary["computed_blocks"] == 3 and summary["devices"] == {"cpu": 3}
    assert _rel(G, ref) < 1e-12


def test_ta_gram_of_sequence_models_with_a_block_store(tmp_path):
    # ta.gram(..., out=) of sequence models in memory goes to the blocked store and gives the
    # unblocked closure Gram (same closure_gram / closure_cross_gram operations per block)
    rng = np.random.default_rng(21)
    g = lambda *s: rng.standard_normal(s) * 0.5  # noqa: E731

    def model():
        attn = ta.BilinearAttention(g(1, 2, 2), g(1, 2, 2), g(1, 2, 2), g(1, 2, 2), g(1, 2, 2),
                                    g(2, 1, 2))
        return ta.Sequential([ta.Residual(attn), ta.Linear(g(2, 2))])

    models = [model() for _ in range(3)]
    want = ta.gram(models, n_ctx=2, method="closure")
    got = ta.gram(models, n_ctx=2, method="closure", out=tmp_path / "store", block_size=2)
    # blocks come from closure_cross_gram on 2-model stacks, the reference from one
    # closure_gram: the same sums grouped differently, so rounding only (a few ulps)
    assert np.allclose(got, want, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------------------
# the exact S<=K matrix (degree=K, --degree K) in blocks
# ----------------------------------------------------------------------------------------

def _degree_ref(paths, n_ctx=3):
    return ta.degree_similarity_matrix(_lm_nets(paths, n_ctx), n_ctx=n_ctx, max_degree=5)


def test_blocked_degree_matrix_equals_unblocked(lm_ckpts, tmp_path, capsys):
    """S<=5 of two-layer checkpoints in blocks of 1 and 3 (diagonal and off-diagonal blocks)
    = the unblocked degree_similarity_matrix within 1e-12 (the same operations per pair:
    each block builds its models' chaos forms once, then `tree_gram` / `tree_cross_gram`)."""
    paths = lm_ckpts[2]
    ref = _degree_ref(paths)
    for b in (1, 3):
        G = blocks.gram(paths, block_size=b, degree=5)
        assert np.max(np.abs(G - ref.gram[5]) / np.abs(ref.gram[5])) <= 1e-12
    out = tmp_path / "m"
    assert main(["matrix", *paths, "--out", str(out), "--degree", "5", "--block-size", "3"]) == 0
    text = capsys.readouterr().out
    assert "3 blocks of up to 3 checkpoints per side: 0 resumed, 3 computed" in text
    assert "S<=5 (exact)" in text
    res = json.loads((out / "matrix.json").read_text())
    assert res["degree"] == 5 and res["method"] == "exact" and res["n_ctx"] == 3
    assert np.max(np.abs(np.load(out / "matrix.npy") - ref[5])) <= 1e-12
    # the library entry point with a store: one per K, the same values
    M = ta.degree_similarity_matrix(_lm_nets(paths), n_ctx=3, max_degree=5,
                                    out=tmp_path / "api", block_size=2)
    assert np.max(np.abs(M.gram[5] - ref.gram[5]) / np.abs(ref.gram[5])) <= 1e-12
    assert (tmp_path / "api" / "degree_5" / "manifest.json").is_file()


def test_blocked_degree_interrupt_then_resume_is_bit_identical(lm_ckpts, tmp_path):
    paths = lm_ckpts[2]
    full = blocks.gram(paths, block_size=2, degree=5)   # 3 blocks, uninterrupted

    def stop_after_one(done, total):
        if done == 1:
            raise KeyboardInterrupt

    store = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        blocks.gram(paths, store, block_size=2, degree=5, on_block=stop_after_one)
    files = _block_files(store)
    assert len(files) == 1
    stamp = (store / files[0]).stat().st_mtime_ns
    with pytest.raises(ValueError, match="degree was 5, now 1"):
        blocks.gram(paths, store, block_size=2, degree=1)
    G, summary = blocks.gram(paths, store, block_size=2, degree=5, return_summary=True)
    assert summary["resumed_blocks"] == 1 and summary["computed_blocks"] == 2
    assert (store / files[0]).stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(G, full)


def test_blocked_degree_refusals_before_any_block(lm_ckpts, tmp_path, capsys):
    from tensoralg.homogeneous import truncation_trees
    from tensoralg.prepare import position_selector
    from tensoralg.strategies import sequence_exact
    from tensoralg.transformer import BilinearTransformer

    paths, calls = lm_ckpts[2], []
    other = tmp_path / "dhead4"
    save_checkpoint(other, BilinearTransformer(7, 4, 2, 2, 4, n_ctx=3, rope=100.0, seed=0,
                                               dtype="float64"))
    cases = [
        # a checkpoint of another shape: named with the first mismatch
        (dict(sources=paths[:2] + [str(other)] + paths[2:]), ValueError,
         rf"{other} has a different architecture from {paths[0]} \(d_head: 2 vs 4, "),
        # the largest block over the memory budget: its estimate
        (dict(sources=paths, max_memory=10_000), ta.CostTooHigh,
         r"degree=5: a block of 4 models \(4 pairs, block_size=2\) needs an estimated "
         r"[0-9.e-]+ GiB .* and [0-9.e+]+ FLOPs, over max_memory=.*--block-size"),
        # one pair over the FLOP budget
        (dict(sources=paths, max_flops=1000), ta.CostTooHigh,
         rf"degree=5: one pair of {paths[0]}: .*FLOPs.*over max_flops=1e\+03"),
        (dict(sources=lm_ckpts[1], degree=9), ValueError, r"degree: 9 is above the degree 5"),
        (dict(sources=paths, method="closure"), ValueError, r"S<=5 matrix \(degree=5\) is exact"),
    ]
    for k, (kw, exc, msg) in enumerate(cases):
        kw.setdefault("degree", 5)
        with pytest.raises(exc, match=msg):
            blocks.gram(kw.pop("sources"), tmp_path / f"s{k}", block_size=2,
                        on_block=lambda d, t: calls.append(d), **kw)
        assert not (tmp_path / f"s{k}").exists()
    assert calls == []
    # biases: S<=5 is not exact for them (named), models in memory
    rng = np.random.default_rng(3)
    g = lambda *s: rng.standard_normal(s) * 0.5  # noqa: E731
    attn = lambda **b: ta.Residual(ta.BilinearAttention(*(g(1, 2, 2) for _ in range(5)),  # noqa: E731
                                                        g(2, 1, 2), **b))
    plain = ta.Sequential([attn(), attn()])
    biased = ta.Sequential([attn(q1_bias=g(1, 2)), attn()])
    with pytest.raises(ValueError, match=r"S<=5 is not exact for sources\[1\] \(biases"):
        blocks.gram([plain, biased], tmp_path / "b", degree=5, n_ctx=2, block_size=1)
    assert not (tmp_path / "b").exists()
    # the block estimate is the pair estimate's arithmetic: 2 models, 1 pair = one pair's
    t = truncation_trees([plain], 2, 5, ["plain"])[0]
    sel = position_selector(2, None, False)
    assert sequence_exact.tree_block_cost(t, 2, 2, 1)[1] == \
        sequence_exact._dry_cost(t, t, 2, False, sel, ())[1]
    # the CLI: exit 2, one line, nothing written
    for extra, msg in ([["--method", "closure"], "--method closure: --degree 5 computes"],
                       [["--output", "1"], "--output: not supported with --degree"]):
        assert main(["matrix", *paths, "--out", str(tmp_path / "c"), "--degree", "5",
                     *extra]) == 2
        assert msg in capsys.readouterr().err
        assert not (tmp_path / "c" / "blocks").exists()
    assert main(["matrix", *paths, str(other), "--out", str(tmp_path / "c"), "--degree",
                 "5"]) == 2
    assert "(d_head: 2 vs 4, " in capsys.readouterr().err
