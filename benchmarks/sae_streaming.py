"""Training from a live model against training from a memory-mapped .npy of the same activations,
and the memory of the stream.

    python benchmarks/sae_streaming.py [--steps 600] [--reps 3] [--json out.json]

Model: a BilinearTransformer of the quick model's sizes (2 blocks, d_model 32, n_ctx 16;
untrained: the speed does not depend on the weights), hook ``hook_resid.1``, on the train split of
the offline corpus. SAE: abstopk, d_sae 128, k 8, batch 256, one thread. Each measurement runs in
its own process (its peak RSS is the process's ``ru_maxrss``), the arms interleaved:

* ``stream``: `ActivationStream` with a 65 536-row buffer;
* ``npy``: the same activations (every token of every sequence the stream reads from) collected
  first to a .npy by ``collect_activations`` and trained from its memmap (collection not timed);
* memory: the stream with buffers of 8 192 and 131 072 rows, and with 4x the steps.

Samples/s is the trainer's own ``samples_per_s`` (steps x batch / wall seconds of the loop,
including the stream's forward passes).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ARMS = ("stream", "npy")


def child(mode, steps, buffer, npy):
    import torch

    torch.set_num_threads(1)
    from tensoralg.corpus import VOCAB
    from tensoralg.sae.presets import make_config
    from tensoralg.sae.streaming import ActivationStream, corpus_tokens
    from tensoralg.sae.training import TrainConfig, train
    from tensoralg.transformer import BilinearTransformer

    model = BilinearTransformer(len(VOCAB), 32, 2, 4, 8, 64, n_ctx=16, rope=10000.0, seed=0).eval()
    toks, _ = corpus_tokens(16)
    cfg = make_config("abstopk", 32, 128, 8)
    tc = TrainConfig(steps=steps, batch_size=256, seed=0, log_every=max(steps, 1))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "collect":
        from tensoralg.sae.hooks import collect_activations
        t = torch.as_tensor(toks)
        collect_activations(model, "hook_resid.1", [t[i:i + 512] for i in range(0, len(t), 512)],
                            npy, progress=False)
        return {}
    if mode == "npy":
        data = npy
    else:
        data = ActivationStream(model, "hook_resid.1", toks, buffer_size=buffer, seed=0)
    sae, hist = train(data, cfg, tc)
    out = {"mode": mode, "steps": steps, "buffer": buffer,
           "samples_per_s": sae.train_summary["samples_per_s"],
           "fvu": hist[-1]["fvu"], "maxrss_mb_before_train": rss0 / 1024,
           "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if mode == "stream":
        out["buffer_mb"] = data.buffer_bytes / 2**20
        out["refills"] = data.refills_computed
    return out


def run(*args):
    r = subprocess.run([sys.executable, __file__, "--child", *map(str, args)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=4)
    a = ap.parse_args()
    if a.child:
        mode, steps, buffer, npy = a.child
        print(json.dumps(child(mode, int(steps), int(buffer), npy)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        npy = os.path.join(tmp, "acts.npy")
        run("collect", 0, 0, npy)
        speed = []
        for rep in range(a.reps):
            for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                speed.append(run(arm, a.steps, 65536, npy))
                print(json.dumps(speed[-1]), flush=True)
        memory = [run("stream", steps, buf, npy) for buf, steps in
                  ((8192, a.steps), (131072, a.steps), (8192, 4 * a.steps))]
        for m in memory:
            print(json.dumps(m), flush=True)
    med = {arm: sorted(r["samples_per_s"] for r in speed if r["mode"] == arm)[a.reps // 2]
           for arm in ARMS}
    print(f"median samples/s: stream {med['stream']:,.0f}, npy {med['npy']:,.0f}, ratio "
          f"{med['stream'] / med['npy']:.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"speed": speed, "memory": memory, "median": med}, fh, indent=1)


if __name__ == "__main__":
    main()
