"""``python -m tensoralg.verify [--quick] [--only SUBSTRING] [--json PATH]``: run the symbolic proofs.

Prints a table (identity, sizes, PASS/FAIL, number of exact equalities checked, seconds) and
exits 1 if any check fails (2 on a usage error).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensoralg.verify",
        description="Symbolic (sympy) proofs of tensoralg's identities on small cases: "
                    "polarization, Isserlis (centred, covariance, lifted, non-centred), the "
                    "(1+x)^2 trap, the single-layer Gram closed form, and invariances.")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes (well under a minute)")
    parser.add_argument("--only", metavar="SUBSTRING", default=None,
                        help="run only the checks whose label contains SUBSTRING")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)

    from . import symbolic

    t0 = time.perf_counter()
    try:
        results = symbolic.run_all(quick=args.quick, only=args.only)
    except KeyboardInterrupt:
        print("python -m tensoralg.verify: interrupted", file=sys.stderr)
        return 130
    total = time.perf_counter() - t0
    if not results:
        print(f"python -m tensoralg.verify: error: no check matches --only {args.only!r}", file=sys.stderr)
        return 2
    print(symbolic.format_table(results))
    n_fail = sum(not r.passed for r in results)
    print(f"\n{len(results) - n_fail}/{len(results)} passed in {total:.1f} s"
          + (" (quick)" if args.quick else ""))
    if args.json:
        try:
            from tensoralg._version import __version__ as version
        except Exception:  # pragma: no cover - verify also works without the package
            version = None
        payload = {"tensoralg_version": version, "python": platform.python_version(),
                   "config": {"quick": args.quick, "only": args.only},
                   "seconds": total, "passed": n_fail == 0,
                   "results": [r.to_dict() for r in results]}
        from tensoralg.io import atomic_write_json  # imported here: an optional dependency

        try:
            atomic_write_json(args.json, payload)
        except OSError as exc:
            print(f"python -m tensoralg.verify: error: --json: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
