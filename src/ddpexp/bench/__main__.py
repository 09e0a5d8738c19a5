"""python -m ddpexp.bench: A (the tutorial's loop), B (a tight hand-written loop), C (python -m ddpexp), side by side
(and D, Lightning, with --lightning; T, C logging to --trackers, with it).

One run alternates A, B, C (, D) `--repeats` times per world size, on the same model, data (an MNIST-format set at
--root: real MNIST when its IDX files are there, else synthetic digits written there), batch per rank, seed and
steps, and prints the medians as a markdown table with the ratios the README quotes. It also writes
OUT/results.json and OUT/results.md. Figures:

- samples/s: steady state, over the steps after --warmup (all ranks' samples per second of wall time);
- first step: seconds from starting the command to the end of rank 0's first optimizer step;
- peak RSS per rank (MiB), and whether B's and C's final weights are bit-equal (same seed and data order)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddpexp.bench.digits import has_mnist, write_mnist_idx

LOOPS = {"A": "tutorial", "B": "tight", "C": "ddpexp", "D": "lightning", "T": "ddpexp + trackers"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(loop: str, args: argparse.Namespace, world_size: int, out: Path) -> list[str]:
    if loop not in "CT":
        module = ["ddpexp.bench.lightning_loop"] if loop == "D" else ["ddpexp.bench.loops", LOOPS[loop]]
        return [
            sys.executable, "-m", *module, "--root", str(args.root), "--world-size", str(world_size),
            "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--port", str(0 if loop in "AB" else free_port()), "--out", str(out),
            "--device", args.device,
        ]  # fmt: skip
    exact = ["precision=fp32", "channels_last=false"] if args.exact else []  # else ddpexp's defaults for the device
    tracked = []  # T: C with --trackers (W&B offline; MLflow's store beside the runs)
    if loop == "T":
        tracked = [f"tracker=[{args.trackers}]", f"tracker.mlflow.tracking_uri=sqlite:///{out.parent}/mlflow.db"]
        tracked = tracked if "mlflow" in args.trackers.split(",") else tracked[:1]
        tracked += ["wandb.mode=offline"] if "wandb" in args.trackers.split(",") else []
    return [
        sys.executable, "-m", "ddpexp", "launcher=spawn", f"gpus={world_size}", f"device={args.device}", *exact,
        f"model={args.model}", "data=mnist", f"data.root={args.root}", f"batch_size={args.batch}",
        f"max_steps={args.steps}", "epochs=1000", "eval_every_n_epochs=1000", "optimizer=adamw", "scheduler=none",
        f"seed={args.seed}", "wandb.mode=disabled", "progress_bar=false", f"log_every_n_steps={args.warmup}",
        f"hydra.run.dir={out}", *tracked,
    ]  # fmt: skip


def run_one(
    loop: str, args: argparse.Namespace, world_size: int, out: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Start one command (in `env`: default, this process's), wait for it (hard timeout), and read its figures
    back from what it wrote."""
    for attempt in (1, 2):  # a rare crash at exit (seen once from A's plain loop) costs one rerun, not the table
        shutil.rmtree(out, ignore_errors=True)  # the bench's own output of an earlier run (ddpexp would resume it)
        t0 = time.time()
        cmd = command(loop, args, world_size, out)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        if proc.returncode == 0:
            break
        failure = f"bench: {loop} (world size {world_size}) failed, exit {proc.returncode}:\n{proc.stderr[-3000:]}"
        if attempt == 2:
            raise SystemExit(failure)
        print(f"{failure}\nbench: running {loop} (world size {world_size}) once more", flush=True)
    if loop in "CT":
        summary = json.loads((out / "summary.json").read_text())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "samples_per_s" in r and r["step"] > args.warmup]  # the first interval warms up
        samples = [
            (r["step"] - prev) * args.batch * world_size
            for prev, r in zip([args.warmup] + [r["step"] for r in rows], rows)
        ]
        seconds = sum(n / r["samples_per_s"] for n, r in zip(samples, rows))
        result = {"first_step_at": summary["first_step_at"], "samples_per_s": sum(samples) / seconds}
        result.update(peak_rss_mb=summary["peak_rss_mb"], threads_per_rank=summary["threads_per_rank"])
        weights = out / "checkpoints" / "last.pt"
    else:
        result = json.loads((out / "result.json").read_text())
        weights = out / "weights.pt"
    result["first_step_s"] = result["first_step_at"] - t0
    result["attempts"] = attempt
    result["weights"] = str(weights)
    return result


def same_weights(a: str, b: str) -> bool:
    import torch

    wa = torch.load(a, weights_only=True, map_location="cpu")
    wb = torch.load(b, weights_only=True, map_location="cpu")
    wa, wb = wa.get("model", wa), wb.get("model", wb)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def table(results: dict[str, Any]) -> str:
    lines = [
        "| world size | loop | samples/s (median) | runs | first step s (median) | peak RSS MiB/rank | B = C weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for ws, per in results["by_world_size"].items():
        for loop in results["loops"]:
            m = per[loop]
            runs = ", ".join(f"{v:.0f}" for v in m["samples_per_s_runs"])
            runs += f" ({m['reruns']} rerun after a crash)" if m["reruns"] else ""
            eq = ("bit-equal" if per["b_equals_c"] else "DIFFERENT") if loop == "C" else ""
            lines.append(
                f"| {ws} | {loop} ({LOOPS[loop]}) | {m['samples_per_s']:.0f} | {runs} | {m['first_step_s']:.1f} "
                f"| {max(m['peak_rss_mb']):.0f} | {eq} |"
            )
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" if "first step" in k else f"| {k} | {v:.3f} |" for k, v in results["ratios"].items()]
    return "\n".join(lines)


def ratios(by_ws: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ws, per in by_ws.items():
        c, b, a = (per[k]["samples_per_s"] for k in "CBA")
        out[f"C / B samples/s, world size {ws}"] = c / b
        out[f"C / A samples/s, world size {ws}"] = c / a
        if "D" in per:
            out[f"C / D samples/s, world size {ws}"] = c / per["D"]["samples_per_s"]
        if "T" in per:
            out[f"T / C samples/s, world size {ws}"] = per["T"]["samples_per_s"] / c
        out[f"C - B first step s, world size {ws}"] = per["C"]["first_step_s"] - per["B"]["first_step_s"]
    if "1" in by_ws and "2" in by_ws:
        out["C world size 2 / C world size 1 samples/s"] = (
            by_ws["2"]["C"]["samples_per_s"] / by_ws["1"]["C"]["samples_per_s"]
        )
    return out


def machine() -> dict[str, Any]:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }  # fmt: skip


def _refuse(line: str) -> Any:
    """Bad arguments: one line and exit 2 (argparse would print its whole usage first)."""
    print(line, file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpexp.bench", description=__doc__.split("\n\n")[0])
    p.error = lambda message: _refuse(f"{p.prog}: error: {message}")  # type: ignore[method-assign]
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet18"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    p.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="C in fp32 without channels_last, as B (default on cpu; on cuda C runs its fast defaults: bf16 etc.)",
    )
    p.add_argument("--lightning", action="store_true", help="also D: Lightning's ddp_spawn (the bench extra)")
    p.add_argument("--trackers", default="", help="also T: C with tracker=[THESE], e.g. wandb,tensorboard,mlflow")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=128, help="per rank")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=25, help="steps excluded from samples/s (C logs every this many)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n-train", type=int, default=20000, help="synthetic images written when --root has no MNIST")
    p.add_argument("--n-test", type=int, default=2000)
    p.add_argument("--root", type=Path, default=Path("bench/data"))
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per command")
    p.add_argument("--plan", action="store_true", help="print the command of each loop and run nothing")
    args = p.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup={args.warmup}: must be >= 1 and < --steps={args.steps}")
    if args.repeats < 1 or min(args.world_sizes) < 1:
        p.error("--repeats and --world-sizes must be >= 1")
    if args.exact is None:
        args.exact = args.device == "cpu"
    if args.lightning and importlib.util.find_spec("lightning") is None:
        p.error("--lightning: Lightning is not installed (pip install -e '.[bench]')")
    loops = "ABCD" if args.lightning else "ABC"
    if args.trackers:
        loops += "T"
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < max(args.world_sizes):
            p.error(f"--device cuda --world-sizes {max(args.world_sizes)}: {torch.cuda.device_count()} GPUs visible")
    args.root = args.root.resolve()
    if args.plan:  # the arguments are checked above; what would run, repeated --repeats times in turn
        for ws in args.world_sizes:
            for loop in loops:
                print(f"{loop} ws{ws}: {shlex.join(command(loop, args, ws, args.out / 'runs' / f'ws{ws}-{loop}-0'))}")
        return 0
    if has_mnist(args.root):
        print(f"bench: MNIST files found at {args.root}: using them", flush=True)
    else:
        write_mnist_idx(args.root, args.n_train, args.n_test, args.seed)
        print(
            f"bench: wrote {args.n_train} + {args.n_test} synthetic 28x28 digits (MNIST IDX) to {args.root}", flush=True
        )
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"

    raw: dict[str, dict[str, list[dict[str, Any]]]] = {str(ws): {k: [] for k in loops} for ws in args.world_sizes}
    for i in range(args.repeats):
        for ws in args.world_sizes:
            for loop in loops:
                out = runs / f"ws{ws}-{loop}-{i}"
                r = run_one(loop, args, ws, out)
                raw[str(ws)][loop].append(r)
                print(f"bench: repeat {i + 1}/{args.repeats} world size {ws} {loop}: {r['samples_per_s']:.0f} samples/s, "
                      f"first step {r['first_step_s']:.1f} s", flush=True)  # fmt: skip

    by_ws: dict[str, Any] = {}
    for ws, per in raw.items():
        by_ws[ws] = {
            loop: {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                "samples_per_s_runs": [r["samples_per_s"] for r in rs],
                "first_step_s": statistics.median(r["first_step_s"] for r in rs),
                "peak_rss_mb": [max(r["peak_rss_mb"][k] for r in rs) for k in range(len(rs[0]["peak_rss_mb"]))],
                "threads_per_rank": rs[0]["threads_per_rank"],
                "reruns": sum(r["attempts"] - 1 for r in rs),  # runs that crashed once and were run again
            }
            for loop, rs in per.items()
        }
        by_ws[ws]["b_equals_c"] = all(same_weights(b["weights"], c["weights"]) for b, c in zip(per["B"], per["C"]))
    results = {
        "machine": machine(),
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "loops": loops,
        "by_world_size": by_ws,
    }
    results["ratios"] = ratios(by_ws)
    md = table(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(md + "\n")
    print(md)
    print(f"bench: wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    # Bit-equality is the CPU's promise (fp32, same kernels); on a GPU cuDNN's algorithm choice and bf16 differ.
    return 0 if args.device == "cuda" or all(per["b_equals_c"] for per in by_ws.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
