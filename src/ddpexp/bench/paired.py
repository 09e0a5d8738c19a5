"""`python -m ddpexp.bench.paired --before SRC`: C (the bench's ddpexp command) on another ddpexp source tree and
on this one, alternating, N pairs per world size: whether a change costs per-step speed, with the slow drift of a
shared machine paired out (the order flips every pair, so neither tree always runs second).

SRC is the `src` folder of a checkout of the earlier code (e.g. `git worktree add /tmp/before COMMIT`, then
`--before /tmp/before/src`); it is put first on PYTHONPATH for its runs. Prints each pair and, per world size,
both trees' medians, the mean paired change (after / before - 1) with its standard error, and in how many pairs
the code here was slower. The data is the bench's (`--root`: MNIST files, made by `python -m ddpexp.bench`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from ddpexp.bench import __main__ as bench
from ddpexp.bench.digits import has_mnist


def summarize(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """(before, after) samples/s per pair -> medians, mean change and its standard error, pairs slower after."""
    changes = [after / before - 1 for before, after in pairs]
    se = statistics.stdev(changes) / len(changes) ** 0.5 if len(changes) > 1 else float("nan")
    return {
        "pairs": len(pairs),
        "median_before": statistics.median(b for b, _ in pairs),
        "median_after": statistics.median(a for _, a in pairs),
        "mean_change": statistics.mean(changes),
        "se_change": se,
        "slower_after": sum(c < 0 for c in changes),
    }


def line(ws: int, s: dict[str, Any]) -> str:
    return (
        f"world size {ws}: median samples/s {s['median_before']:,.0f} before, {s['median_after']:,.0f} after; "
        f"mean paired change {100 * s['mean_change']:+.1f} % (standard error {100 * s['se_change']:.1f} %); "
        f"slower after in {s['slower_after']} of {s['pairs']} pairs"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpexp.bench.paired", description=__doc__.split("\n\n")[0])
    p.error = lambda message: bench._refuse(f"{p.prog}: error: {message}")  # type: ignore[method-assign]
    p.add_argument("--before", type=Path, required=True, help="the src folder of the earlier code")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--batch", type=int, default=128, help="per rank")
    p.add_argument("--root", type=Path, default=Path("bench/data"))
    p.add_argument("--out", type=Path, default=Path("bench/paired"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per command")
    args = p.parse_args(argv)
    if not (args.before / "ddpexp" / "__init__.py").is_file():
        p.error(f"--before {args.before}: no ddpexp package there (give the src folder of a checkout)")
    if not has_mnist(args.root):
        p.error(f"--root {args.root}: no MNIST files (run python -m ddpexp.bench once, or point at MNIST)")
    if args.pairs < 1 or min(args.world_sizes) < 1 or not 1 <= args.warmup < args.steps:
        p.error("--pairs and --world-sizes must be >= 1, and --warmup >= 1 and < --steps")
    args.model, args.device, args.exact, args.seed, args.trackers = "cnn", "cpu", True, 0, ""
    here_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    before_env = {**here_env, "PYTHONPATH": str(args.before.resolve())}
    results: dict[str, Any] = {}
    for ws in args.world_sizes:
        pairs = []
        for i in range(args.pairs):
            rates = {}
            for which in ("before", "after") if i % 2 == 0 else ("after", "before"):
                env = before_env if which == "before" else here_env
                rates[which] = bench.run_one("C", args, ws, args.out / f"ws{ws}-{i}-{which}", env)["samples_per_s"]
            pairs.append((rates["before"], rates["after"]))
            print(f"world size {ws}, pair {i}: {rates['before']:,.0f} before, {rates['after']:,.0f} after", flush=True)
        results[str(ws)] = {"pairs": pairs, **summarize(pairs)}
    for ws in args.world_sizes:
        print(line(ws, results[str(ws)]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paired.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
