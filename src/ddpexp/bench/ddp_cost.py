"""Where a 2-rank CPU step's time goes: B's tight loop (with ddpexp's allocator setting) run several ways, paired.

    python -m ddpexp.bench.ddp_cost --root bench/data --pairs 2

Each pair runs every variant once, in turn, so the machine's drift hits them alike; the table gives each run's
samples/s, the median, the median against `ddp`, and how busy each rank was (its process's CPU time, and its
main thread's alone, per second of wall time):

- ws1:     1 rank with all the cores as threads (what C at world size 1 does);
- ddp:     N ranks, DDP's gloo all-reduce (what C at world size N does);
- unsynced: N ranks, DDP with a comm hook that hands the gradients back un-reduced: DDP minus the all-reduce
           (the ranks drift apart: timing only);
- barrier: N ranks, no DDP, one `dist.barrier()` per step: what waiting for the slower rank alone costs;
- alone:   N ranks, no DDP: N independent 1-thread trainings, the most N ranks can give.

Every run also reports whether its ranks ended with identical weights (only ws1 and ddp should)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddpexp.bench.digits import has_mnist

VARIANTS = ("ws1", "ddp", "unsynced", "barrier", "alone")


def _unreduced(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks the annotations: none, or its own)
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _rank(rank: int, args: argparse.Namespace, variant: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpexp.bench.loops import _batches_tight, build_model
    from ddpexp.rank import speed

    world_size = 1 if variant == "ws1" else args.world_size
    speed.limit_threads(world_size, speed.cpu_quota())
    speed.keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    net = DDP(model) if variant in ("ws1", "ddp", "unsynced") else model
    if variant == "unsynced":
        net.register_comm_hook(None, _unreduced)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    batches = _batches_tight(args, rank, world_size, torch.device("cpu"))
    for step in range(args.steps):
        if step == args.warmup:
            wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        x, y = next(batches)
        F.cross_entropy(net(x), y).backward()
        if variant == "barrier":
            dist.barrier()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - wall
    busy = ((time.process_time() - cpu) / wall, (time.thread_time() - main) / wall)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, (busy, flat))
    if rank == 0:
        result = {
            "variant": variant,
            "samples_per_s": (args.steps - args.warmup) * args.batch * world_size / wall,
            "process_busy": [round(b[0][0], 3) for b in every],
            "main_thread_busy": [round(b[0][1], 3) for b in every],
            "replicas_identical": all(torch.equal(f, every[0][1]) for _, f in every),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a variant: its ranks spawned afresh; rank 0's figures read back."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        nprocs = 1 if variant == "ws1" else args.world_size
        # Bound here before the ranks start (ranks join as clients): a free port that rank 0 bound later was
        # once taken meanwhile by another process's connection (EADDRINUSE).
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        mp.spawn(_rank, args=(args, variant, store.port, out), nprocs=nprocs)
        with open(out) as f:
            return json.load(f)


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    base = statistics.median(r["samples_per_s"] for r in runs["ddp"])
    lines = [
        "| variant | samples/s runs | median | vs ddp | process busy | main thread busy | replicas identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, rs in runs.items():
        median = statistics.median(r["samples_per_s"] for r in rs)
        busy = statistics.median(b for r in rs for b in r["process_busy"])
        main = statistics.median(b for r in rs for b in r["main_thread_busy"])
        same = "yes" if all(r["replicas_identical"] for r in rs) else "no"
        each = ", ".join(f"{r['samples_per_s']:.0f}" for r in rs)
        lines.append(
            f"| {variant} | {each} | {median:.0f} | {median / base - 1:+.1%} | {busy:.3f} | {main:.3f} | {same} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddpexp.bench.ddp_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="bench/data", help="MNIST-format files (python -m ddpexp.bench writes them)")
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet18"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=128, help="per rank")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pairs", type=int, default=2, help="times every variant is run, in turn")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the runs as JSON here")
    args = p.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup={args.warmup}: must be >= 1 and < --steps={args.steps}")
    if args.world_size < 2 or args.pairs < 1:
        p.error("--world-size must be >= 2 and --pairs >= 1")
    if "ddp" not in args.variants:
        p.error("--variants: must include ddp (the others are compared with it)")
    if not has_mnist(Path(args.root)):
        p.error(f"--root {args.root}: no MNIST files (run python -m ddpexp.bench once, or point at MNIST)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for i in range(args.pairs):
        for variant in args.variants:
            r = run_variant(variant, args)
            runs[variant].append(r)
            print(f"ddp_cost: pair {i + 1}/{args.pairs} {variant}: {r['samples_per_s']:.0f} samples/s", flush=True)
    md = table(runs)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": vars(args), "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
