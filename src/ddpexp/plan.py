"""`plan=true`: what a launch would do, per rank, printed without starting or submitting anything."""

from __future__ import annotations

import sys
from typing import Any


def render(cfg: Any, job: Any, launcher: Any) -> str:
    """launcher.plan(cfg, job) gives {"command", "ranks": [env per rank], "script" (optional)}."""
    p = launcher.plan(cfg, job)
    lines = [
        f"ddpexp plan: launcher={job.launcher}, {len(p['ranks'])} rank(s); nothing was started",
        f"  job dir:   {job.dir}",
        f"  W&B:       mode={cfg.wandb.mode} project={cfg.wandb.project} "
        f"group={cfg.wandb.group or job.group} name={cfg.wandb.name or job.name}",
        f"  command:   {p['command']}",
    ]
    for env in p["ranks"]:
        device = "cpu" if cfg.device == "cpu" else f"cuda:{env['LOCAL_RANK']} (cpu if no GPU)"
        device = f"cuda:{env['LOCAL_RANK']}" if cfg.device == "cuda" else device
        lines.append(f"  rank {env['RANK']}: device={device} " + " ".join(f"{k}={v}" for k, v in env.items()))
    if p.get("script"):
        lines += ["  sbatch script:", *("    " + line for line in p["script"].splitlines())]
    return "\n".join(lines)


def this_command(job: Any) -> str:
    return " ".join([sys.executable, "-m", "ddpexp", *job.command])


def local_ranks(cfg: Any, node_rank: Any, world_size: Any, master: tuple[str, str]) -> list[dict[str, str]]:
    """env:// per local rank; `node_rank` and `world_size` may be formulas when known only at rendezvous."""
    ranks = []
    for local in range(cfg.gpus):
        rank = str(local) if node_rank == 0 else f"{node_rank}*{cfg.gpus}+{local}"
        ranks.append({"RANK": rank, "LOCAL_RANK": str(local), "WORLD_SIZE": str(world_size),
                      "LOCAL_WORLD_SIZE": str(cfg.gpus), "MASTER_ADDR": master[0], "MASTER_PORT": master[1]})  # fmt: skip
    return ranks
