"""Training from a live model: tensoralg's `ActivationStream` against SAELens's streaming runner
(`LanguageModelSAETrainingRunner`), on the same model, hook, tokens and SAE sizes. Not run in CI.

SAELens is not a dependency of tensoralg: run this with the Python of a separate environment
that has SAELens 6.54.12 and tensoralg's own dependencies, tensoralg taken from the checkout:

    python3 -m venv /tmp/venv-saelens
    /tmp/venv-saelens/bin/pip install -c constraints-ci.txt sae-lens==6.54.12 \\
        opt_einsum scikit-learn matplotlib threadpoolctl
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 /tmp/venv-saelens/bin/python benchmarks/saelens_streaming.py \\
        [--steps 300] [--reps 3] [--json out.json]

(Both arms must run where TransformerLens is installed, since the model is SAELens's own model
class; the environment of tensoralg's tests does not have it.)

Offline, nothing downloaded: the model is a TransformerLens `HookedTransformer` built from a
GPT-2-style `HookedTransformerConfig` (2 layers, d_model 64, 4 heads, d_mlp 256, LayerNorm,
gelu_new, learned positions, vocabulary 1,000, context 128, seed 0: the same weights in every
process), hook ``blocks.0.hook_resid_post``, on a fixed random token array (4,096 sequences of
128 tokens, seed 0) — SAELens gets it as a tokenized `datasets.Dataset` (`override_dataset`,
`prepend_bos=False`), tensoralg as the array. SAE: TopK, d_sae 512, k 16, batches of 1,024 tokens,
lr 3e-4, ``--steps`` steps, one thread. Buffers: 65,536 rows, forward passes of 64 sequences
(8,192 tokens) in both (SAELens: ``n_batches_in_buffer`` 8 × ``store_batch_size_prompts`` 64 ×
128; it mixes half of each buffer into the next, tensoralg shuffles each refill). No W&B, no
checkpoints, no final save, no evals in either.

Each run is its own process; the arms are interleaved (ABAB / BABA). Samples/s = training
tokens / wall seconds of the whole training call (SAELens: ``runner.run()``; tensoralg:
``train(stream, ...)``), both including every forward pass of the model and the first buffer
fill; model construction, imports and the runner's setup are outside the timed call.
"""

import argparse
import json
import os
import subprocess
import sys
import time

D_MODEL, CTX, VOCAB, N_SEQ = 64, 128, 1000, 4096
HOOK = "blocks.0.hook_resid_post"
D_SAE, K, BATCH, LR = 512, 16, 1024, 3e-4
BUFFER, FWD = 65536, 64
ARMS = ("tensoralg", "saelens")


def make_model():
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    cfg = HookedTransformerConfig(n_layers=2, d_model=D_MODEL, n_heads=4, d_head=16, d_mlp=256,
                                  n_ctx=CTX, d_vocab=VOCAB, act_fn="gelu_new",
                                  normalization_type="LN", positional_embedding_type="standard",
                                  seed=0, device="cpu")
    return HookedTransformer(cfg).eval()


def make_tokens():
    import numpy as np
    return np.random.default_rng(0).integers(0, VOCAB, size=(N_SEQ, CTX), dtype=np.int64)


def weights_hash(model):
    import hashlib
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def child_tensoralg(steps):
    from tensoralg.sae.presets import make_config
    from tensoralg.sae.streaming import ActivationStream
    from tensoralg.sae.training import TrainConfig, train

    model = make_model()
    stream = ActivationStream(model, HOOK, make_tokens(), buffer_size=BUFFER, seed=0,
                              forward_batch=FWD, vocab_size=VOCAB)
    cfg = make_config("topk", D_MODEL, D_SAE, K)
    tc = TrainConfig(steps=steps, batch_size=BATCH, lr=LR, seed=0, log_every=steps)
    t = time.perf_counter()
    sae, hist = train(stream, cfg, tc)
    secs = time.perf_counter() - t
    return {"arm": "tensoralg", "seconds": secs, "samples_per_s": steps * BATCH / secs,
            "trainer_samples_per_s": sae.train_summary["samples_per_s"],
            "fvu": hist[-1]["fvu"], "model": weights_hash(model)}


def child_saelens(steps):
    import datasets
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        TopKTrainingSAEConfig,
    )

    model = make_model()
    ds = datasets.Dataset.from_dict({"input_ids": make_tokens().tolist()})
    cfg = LanguageModelSAERunnerConfig(
        sae=TopKTrainingSAEConfig(d_in=D_MODEL, d_sae=D_SAE, k=K),
        model_name="offline-gpt2-style", hook_name=HOOK, dataset_path="offline-tokens",
        is_dataset_tokenized=True, streaming=False, context_size=CTX, prepend_bos=False,
        training_tokens=steps * BATCH, train_batch_size_tokens=BATCH,
        n_batches_in_buffer=BUFFER // (FWD * CTX), store_batch_size_prompts=FWD, lr=LR,
        device="cpu", seed=0, n_checkpoints=0, output_path=None, n_eval_batches=0,
        logger=LoggingConfig(log_to_wandb=False), verbose=False)
    runner = LanguageModelSAETrainingRunner(cfg, override_dataset=ds, override_model=model)
    t = time.perf_counter()
    runner.run()
    secs = time.perf_counter() - t
    return {"arm": "saelens", "seconds": secs, "samples_per_s": steps * BATCH / secs,
            "model": weights_hash(model)}


def run(arm, steps):
    r = subprocess.run([sys.executable, __file__, "--child", arm, str(steps)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise SystemExit(f"{arm} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        import torch
        torch.set_num_threads(1)
        arm, steps = a.child
        out = (child_tensoralg if arm == "tensoralg" else child_saelens)(int(steps))
        print(json.dumps(out))
        return
    runs = []
    for rep in range(a.reps):
        for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
            runs.append(run(arm, a.steps))
            print(json.dumps(runs[-1]), flush=True)
    if len({r["model"] for r in runs}) != 1:
        raise SystemExit("the arms did not train on the same model weights")
    med = {arm: sorted(r["samples_per_s"] for r in runs if r["arm"] == arm)[a.reps // 2]
           for arm in ARMS}
    print(f"median samples/s over {a.reps} runs: tensoralg {med['tensoralg']:,.0f}, SAELens "
          f"{med['saelens']:,.0f}, ratio {med['tensoralg'] / med['saelens']:.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"runs": runs, "median": med, "args": vars(a)}, fh, indent=1)


if __name__ == "__main__":
    main()
