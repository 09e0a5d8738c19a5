"""`plan=true`: what a launch would do, per rank, printed without starting or submitting anything."""

from __future__ import annotations

from typing import Any


def render(cfg: Any, job: Any, launcher: Any) -> str:
    """launcher.plan(cfg, job) gives {"command", "ranks": [env per rank], "script" (optional)}."""
    p = launcher.plan(cfg, job)
    lines = [
        f"ddpexp plan: launcher={job.launcher}, {len(p['ranks'])} rank(s); nothing was started",
        f"  job dir:   {job.dir}",
        f"  W&B:       mode={cfg.wandb.mode} project={cfg.wandb.project} "
        f"group={cfg.wandb.group or job.group} name={cfg.wandb.name or job.name}"
        + ("" if "wandb" in cfg.tracker else " (not a tracker of this job)"),
        f"  trackers:  {', '.join(cfg.tracker) or 'none'} (and the run record, metrics.jsonl and summary.json)",
        f"  command:   {p['command']}",
    ]
    for env in p["ranks"]:
        device = "cpu" if cfg.device == "cpu" else f"cuda:{env['LOCAL_RANK']} (cpu if no GPU)"
        device = f"cuda:{env['LOCAL_RANK']}" if cfg.device == "cuda" else device
        lines.append(f"  rank {env['RANK']}: device={device} " + " ".join(f"{k}={v}" for k, v in env.items()))
    if p.get("script"):
        lines += ["  sbatch script:", *("    " + line for line in p["script"].splitlines())]
    return "\n".join(lines)
