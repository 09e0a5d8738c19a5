"""A job's run record as `ddpexp report` and its plots read it: summary.json, metrics.jsonl and .hydra/, found
under the paths a user names. Nothing here needs W&B or torch."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from ddpexp.exceptions import ReportError
from ddpexp.job import read_json

NOT_METRICS = ("step", "epoch", "lr")  # a metrics.jsonl row's other keys; throughput keys end in _per_s
DIRECTIONS = {"min": "minimize", "max": "maximize"}  # summary.json's objective mode -> the report's (Optuna's) word


def is_metric(key: str) -> bool:
    return key not in NOT_METRICS and not key.endswith("_per_s")


@dataclass
class JobRecord:
    """One job as its files tell it; `status` is summary.json's, or incomplete/missing when there is none."""

    dir: str
    name: str
    overrides: dict[str, str]  # key -> value, as on the command line
    status: str
    final: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    error: str | None = None
    steps: int | None = None
    wall_time_s: float | None = None
    world_size: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # .hydra/config.yaml
    objective: dict[str, Any] = field(default_factory=dict)  # summary.json's {name, mode}; older records have none
    directions: dict[str, str] = field(default_factory=dict)  # summary.json's: each metric's, as the task declares


def is_job_dir(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in (".hydra", "summary.json", "metrics.jsonl"))


def find_jobs(paths: list[str]) -> list[str]:
    """Job dirs under each PATH: the PATH itself when it is one, else every job dir below it (a multirun dir). A
    file among several PATHs is skipped: `ddpexp report outputs/DATE/*` also matches the report files an earlier
    report wrote into that folder."""
    found: list[str] = []
    for path in paths:
        if len(paths) > 1 and os.path.isfile(path):
            continue
        if not os.path.isdir(path):
            raise ReportError(f"{path}: no such directory")
        if is_job_dir(path):
            found.append(os.path.abspath(path))
            continue
        jobs = []
        for root, dirs, _ in os.walk(path):
            if root != path and is_job_dir(root):
                jobs.append(os.path.abspath(root))
                dirs.clear()  # a job's own folders (logs, checkpoints, wandb) hold no jobs
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        if not jobs:
            raise ReportError(f"{path}: neither a job dir nor a multirun dir (no summary.json, .hydra/ or job dirs)")
        found += sorted(jobs, key=natural)
    if not found:  # every PATH a file
        raise ReportError(f"{paths[0]}: not a directory (a job dir or a multirun dir)")
    return list(dict.fromkeys(found))


def natural(text: str) -> list[Any]:
    """Sort key: job 10 after job 9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def load_job(job_dir: str, name: str) -> JobRecord:
    summary = read_json(os.path.join(job_dir, "summary.json"))
    rows = read_jsonl(os.path.join(job_dir, "metrics.jsonl"))
    overrides = {}
    for item in read_yaml(os.path.join(job_dir, ".hydra", "overrides.yaml")) or []:
        key, _, value = str(item).partition("=")
        overrides[key.lstrip("+")] = value
    config = read_yaml(os.path.join(job_dir, ".hydra", "config.yaml")) or {}
    if summary is None:  # killed before the record was written: what metrics.jsonl saw so far
        last: dict[str, float] = {}
        for row in rows:
            last.update({k: v for k, v in row.items() if is_metric(k)})
        steps = max((r.get("step", 0) for r in rows), default=None)
        return JobRecord(job_dir, name, overrides, "incomplete" if rows else "missing", last, rows, steps=steps,
                         config=config)  # fmt: skip
    return JobRecord(
        job_dir, name, overrides, str(summary.get("status", "?")), dict(summary.get("final") or {}), rows,
        error=summary.get("error"), steps=summary.get("steps"), wall_time_s=summary.get("wall_time_s"),
        world_size=summary.get("world_size"), config=config, objective=dict(summary.get("objective") or {}),
        directions=dict(summary.get("directions") or {}),
    )  # fmt: skip


UNKNOWN = "unknown"  # the runs recorded no direction for their objective: nothing is sorted, nothing is best


def recorded_direction(jobs: list[JobRecord], metric: str) -> str | None:
    """minimize or maximize, as the jobs' records say for `metric`: the run's objective_mode when it is their
    objective, else its task's declared direction; `unknown` when the runs recorded that no direction was known
    (a task without `directions`); None when no record says (records older than both)."""
    own = [j.objective for j in jobs if j.objective.get("name") == metric]
    modes = [o.get("mode") for o in own] + [j.directions.get(metric) for j in jobs]
    found = next((DIRECTIONS[m] for m in modes if m in DIRECTIONS), None)
    return found or (UNKNOWN if any("mode" in o and o["mode"] is None for o in own) else None)


def guess_direction(objective: str) -> str:
    """For records that hold no mode: a name ending in loss is minimized, anything else maximized."""
    return "minimize" if objective.endswith("loss") else "maximize"


def objective_value(job: JobRecord, objective: str) -> float | None:
    value = job.final.get(objective) if job.status == "completed" else None
    return None if value is None or value != value else float(value)  # NaN: no value


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def fmt_param(value: str | None) -> str:
    """A swept value, short: Optuna writes floats with all their digits."""
    if value is None:
        return ""
    try:
        number = float(value)
    except ValueError:
        return value
    return value if number.is_integer() and "." not in value and "e" not in value.lower() else f"{number:.4g}"


def read_jsonl(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return rows


def read_yaml(path: str) -> Any:
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (FileNotFoundError, yaml.YAMLError):
        return None
