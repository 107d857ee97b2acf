"""Threads: train_classifier on the digits with 1 thread against the libraries' default, measured
side by side (interleaved runs, medians). ``python benchmarks/bench_threads.py [--steps 300]``."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tensoralg as ta
from tensoralg.data import load_digits_data
from tensoralg.nn import BilinearNet, train_classifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = ap.parse_args()
    data = load_digits_data()
    X, y = data.X_train, data.y_train
    default = torch.get_num_threads()
    times = {1: [], 0: []}
    for _ in range(args.rounds):
        for n in (1, 0):
            ta.set_threads(n)
            m = BilinearNet(64, 10, d_model=32, d_hidden=64, residual=True, seed=0)
            t = time.perf_counter()
            train_classifier(m, X, y, steps=args.steps, lr=3e-3)
            times[n].append(time.perf_counter() - t)
    one, dflt = statistics.median(times[1]), statistics.median(times[0])
    print(f"train_classifier, {args.steps} steps: 1 thread {one:.2f} s, default ({default} threads) "
          f"{dflt:.2f} s: ratio default/1 = {dflt / one:.2f} (medians of {args.rounds})")


if __name__ == "__main__":
    main()
