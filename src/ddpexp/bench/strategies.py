"""Memory and speed of strategy=ddp against strategy=fsdp2, on the ~100M-parameter GPT of `experiment=stdlib_gpt`
(8 blocks, n_embd 1024), at 1 and 2 ranks: each a real `python -m ddpexp` job; each rank's peak resident memory
(summary.json's peak_rss_mb; on a GPU, peak_cuda_mb) and the job's tokens/s (the median of its logged steps after
the first `--warmup`).

    python -m ddpexp.bench.strategies [--world-sizes 1 2] [--steps 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GPT = ["experiment=stdlib_gpt", "model.n_layer=8", "model.n_embd=1024", "model.n_head=16", "batch_size=2",
       "data.block_size=32", "data.val_fraction=0.01", "wandb.mode=disabled", "log_every_n_steps=1"]  # fmt: skip


def command(strategy: str, world_size: int, args: argparse.Namespace, job: Path) -> list[str]:
    return [sys.executable, "-m", "ddpexp", *GPT, f"strategy={strategy}", f"gpus={world_size}",
            f"max_steps={args.steps}", f"device={args.device}", f"hydra.run.dir={job}"]  # fmt: skip


def run(strategy: str, world_size: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    job = out / f"{strategy}-ws{world_size}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = subprocess.run(
        command(strategy, world_size, args, job), env=env, capture_output=True, text=True, timeout=args.timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench: {strategy} at {world_size} rank(s) failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((job / "summary.json").read_text())
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > args.warmup]
    memory = summary.get("peak_cuda_mb") or summary["peak_rss_mb"]
    return {"strategy": strategy, "world_size": world_size, "peak_mb_per_rank": memory,
            "tokens_per_s": statistics.median(rates), "steps": summary["steps"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpexp.bench.strategies", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--plan", action="store_true", help="print each job's command and run nothing")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        raise SystemExit(f"bench: --steps {args.steps} must be more than --warmup {args.warmup}")
    if args.plan:
        for world_size in args.world_sizes:
            for strategy in ("ddp", "fsdp2"):
                print(" ".join(command(strategy, world_size, args, Path(f"JOB_{strategy}_ws{world_size}"))))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpexp-bench-") as tmp:
        for world_size in args.world_sizes:
            for strategy in ("ddp", "fsdp2"):
                results.append(run(strategy, world_size, args, Path(tmp)))
                r = results[-1]
                print(f"{strategy:6s} ranks {world_size}: peak MB per rank {r['peak_mb_per_rank']}, "
                      f"{r['tokens_per_s']:.1f} tokens/s", flush=True)  # fmt: skip
    for world_size in args.world_sizes:
        ddp, fsdp2 = (next(r for r in results if r["strategy"] == s and r["world_size"] == world_size)
                      for s in ("ddp", "fsdp2"))  # fmt: skip
        memory = max(fsdp2["peak_mb_per_rank"]) / max(ddp["peak_mb_per_rank"])
        speed = fsdp2["tokens_per_s"] / ddp["tokens_per_s"]
        print(f"ranks {world_size}: fsdp2/ddp peak memory {memory:.2f}x, tokens/s {speed:.2f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
