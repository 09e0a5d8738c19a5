"""`ddpexp report PATH...`: the jobs of a sweep (or several run dirs) as one table sorted by the objective, read
from their run records alone (summary.json, metrics.jsonl, .hydra/), and written as report.md, report.csv and
PNG plots. Offline: needs no W&B."""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Any

from ddpexp.exceptions import ReportError
from ddpexp.report.records import (
    UNKNOWN,
    JobRecord,
    find_jobs,
    fmt,
    fmt_param,
    guess_direction,
    is_job_dir,
    load_job,
    natural,
    objective_value,
    read_yaml,
    recorded_direction,
)

FILES = ("report.md", "report.csv", "report_curves.png", "report_objective.png")


def swept_keys(jobs: list[JobRecord]) -> list[str]:
    """Override keys that tell the jobs apart (all of them for a single job), in command-line order."""
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    if len(jobs) == 1:
        return keys
    return [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]


def sort_jobs(jobs: list[JobRecord], objective: str, maximize: bool) -> list[JobRecord]:
    """Best first; jobs without a value (failed, unfinished) after them, in job order."""

    def key(j: JobRecord) -> tuple[Any, ...]:
        value = objective_value(j, objective)
        return (value is None, 0.0 if value is None else (-value if maximize else value), natural(j.name))

    return sorted(jobs, key=key)


def table(jobs: list[JobRecord], swept: list[str], metrics: list[str]) -> tuple[list[str], list[list[str]]]:
    header = ["#", "job", *swept, "status", *metrics, "steps", "wall_s", "ranks"]
    rows = []
    for i, j in enumerate(jobs, 1):
        rows.append([
            str(i), j.name, *(fmt_param(j.overrides.get(k)) for k in swept), j.status,
            *(fmt(j.final.get(m)) for m in metrics), fmt(j.steps),
            "" if j.wall_time_s is None else f"{j.wall_time_s:.1f}", fmt(j.world_size),
        ])  # fmt: skip
    return header, rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def md_table(header: list[str], rows: list[list[str]]) -> str:
    cell = lambda c: c.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(cell(c) for c in r) + " |" for r in [header, *rows]]
    return "\n".join([lines[0], "|" + "|".join("---" for _ in header) + "|", *lines[1:]])


def problems(jobs: list[JobRecord]) -> list[str]:
    """One line per job that did not complete, with its error."""
    out = []
    for j in jobs:
        if j.status == "completed":
            continue
        why = j.error or {"missing": "no run record (killed before its ranks wrote anything?)",
                          "incomplete": f"no summary.json: stopped after step {j.steps} (killed?)"}.get(j.status, "")  # fmt: skip
        out.append(f"job {j.name} ({j.status}): {why}".rstrip(": "))
    return out


def sweep_facts(paths: list[str], job_dirs: list[str]) -> dict[str, Any]:
    """What the sweep dir says about the study: its direction and Optuna's result, when there is one. The basic
    sweeper writes multirun.yaml; Optuna's does not, but each job's .hydra/hydra.yaml holds the same sweeper."""
    if len(paths) != 1:
        return {}
    facts: dict[str, Any] = {}
    multirun = read_yaml(os.path.join(paths[0], "multirun.yaml"))
    if multirun is None and job_dirs:
        multirun = read_yaml(os.path.join(job_dirs[0], ".hydra", "hydra.yaml"))
    direction = ((multirun or {}).get("hydra", {}).get("sweeper") or {}).get("direction")
    if isinstance(direction, str):
        facts["direction"] = direction
    results = read_yaml(os.path.join(paths[0], "optimization_results.yaml"))
    if results and "best_value" in results:
        facts["optuna"] = results
    return facts


def build(paths: list[str], objective: str | None, direction: str | None) -> dict[str, Any]:
    """Everything the report shows, from the run records under `paths`."""
    job_dirs = find_jobs(paths)
    if len(paths) == 1:  # a multirun dir, or one run: the files go into it
        out_dir = os.path.abspath(paths[0])
        base = out_dir if not is_job_dir(out_dir) else os.path.dirname(out_dir)
    else:  # several runs: into the folder that holds them all
        out_dir = base = os.path.commonpath(job_dirs)
    jobs = [load_job(d, os.path.relpath(d, base) if d != base else os.path.basename(d)) for d in job_dirs]
    facts = sweep_facts(paths, job_dirs)
    own = next((str(j.config["objective"]) for j in jobs if "objective" in j.config), "val/acc")
    asked, objective = objective, objective or own
    if direction is None:  # the records' mode; else the sweeper's, about the jobs' own objective; else the name's
        swept_direction = facts.get("direction") if objective == own else None
        direction = recorded_direction(jobs, objective) or swept_direction or guess_direction(objective)
    if direction != UNKNOWN:  # else in job order: no value is better than another
        jobs = sort_jobs(jobs, objective, direction == "maximize")
    seen = {k for j in jobs for k in j.final}
    known = sorted(seen or {"train/loss", "val/loss", "val/acc"})  # nothing finished: the usual names only
    if asked and asked not in known:
        raise ReportError(f"--objective {objective}: no job has this metric; available: {', '.join(known)}")
    # The objective, every other metric any job logged (in the order they logged them), train/loss last.
    logged = [m for m in dict.fromkeys(m for j in jobs for m in j.final) if m != "train/loss"]
    metrics = [objective] + [m for m in (*logged, "train/loss") if m in seen and m != objective]
    swept = swept_keys(jobs)
    fixed = [f"{k}={v}" for k, v in jobs[0].overrides.items() if k not in swept] if len(jobs) > 1 else []
    return dict(jobs=jobs, out_dir=out_dir, objective=objective, direction=direction, metrics=list(dict.fromkeys(metrics)),
                swept=swept, fixed=fixed, facts=facts)  # fmt: skip


def write_csv(path: str, r: dict[str, Any]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "job", "dir", *r["swept"], "status", *r["metrics"], "steps", "wall_time_s", "world_size",
                    "error"])  # fmt: skip
        for i, j in enumerate(r["jobs"], 1):
            w.writerow([
                i, j.name, j.dir, *(j.overrides.get(k, "") for k in r["swept"]), j.status,
                *(j.final.get(m, "") for m in r["metrics"]), j.steps if j.steps is not None else "",
                j.wall_time_s if j.wall_time_s is not None else "", j.world_size or "", j.error or "",
            ])  # fmt: skip


def headline(r: dict[str, Any]) -> list[str]:
    jobs, objective = r["jobs"], r["objective"]
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.status] = counts.get(j.status, 0) + 1
    lines = [f"{len(jobs)} job(s): " + ", ".join(f"{n} {s}" for s, n in counts.items())
             + f"; objective {objective} ({r['direction']})"]  # fmt: skip
    best = jobs[0] if r["direction"] != UNKNOWN and objective_value(jobs[0], objective) is not None else None
    if best is not None:
        lines.append(f"best: job {best.name}, {objective}={fmt(objective_value(best, objective))}")
    if "optuna" in r["facts"]:
        o = r["facts"]["optuna"]
        params = ", ".join(f"{k}={fmt_param(str(v))}" for k, v in (o.get("best_params") or {}).items())
        lines.append(f"optuna (optimization_results.yaml): best_value={fmt(o['best_value'])}, {params}")
    if r["fixed"]:
        lines.append("same in every job: " + " ".join(r["fixed"]))
    return lines


def write_md(path: str, r: dict[str, Any], header: list[str], rows: list[list[str]], plots: list[str]) -> None:
    parts = [f"# ddpexp report: {r['out_dir']}", "", *(f"- {line}" for line in headline(r)), "", md_table(header, rows)]
    if problems(r["jobs"]):
        parts += ["", "## Jobs that did not complete", "", *(f"- {p}" for p in problems(r["jobs"]))]
    titles = {"report_curves.png": "curves", "report_objective.png": f"{r['objective']} vs each swept parameter"}
    parts += ["", *(f"![{titles[p]}]({p})" for p in plots)]
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main(argv: list[str]) -> int:
    from ddpexp.report import plots

    parser = _Parser(
        prog="ddpexp report",
        description="Tabulate a sweep's jobs (or several runs) from their run records, best first; write report.md, "
        "report.csv and PNG plots.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a multirun dir, or several run dirs")
    parser.add_argument("--objective", help="metric to sort by: any the jobs logged (default: the jobs' `objective`)")
    parser.add_argument("--direction", choices=("maximize", "minimize"),
                        help="default: the jobs' recorded objective mode, else the sweeper's, else by name")  # fmt: skip
    parser.add_argument("--out", help="where the files go (default: the multirun dir, or the runs' common parent)")
    args = parser.parse_args(argv)
    try:
        r = build(args.paths, args.objective, args.direction)
    except ReportError as e:
        print(f"ddpexp: error: {e}", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(args.out or r["out_dir"])
    header, rows = table(r["jobs"], r["swept"], r["metrics"])
    try:
        os.makedirs(out_dir, exist_ok=True)
        written = plots.write_all(out_dir, r)
        write_csv(os.path.join(out_dir, "report.csv"), r)
        write_md(os.path.join(out_dir, "report.md"), r, header, rows, written)
    except OSError as e:
        from ddpexp.job import why_not_dir

        print(f"ddpexp: error: {out_dir}: cannot write the report there: {why_not_dir(out_dir, e)}", file=sys.stderr)
        return 2
    lines = [*headline(r), "", text_table(header, rows), *problems(r["jobs"])]
    lines.append(f"ddpexp: wrote {', '.join(['report.md', 'report.csv', *written])} in {out_dir}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `ddpexp report DIR | head`: the files are written, the rest of the table unread
        sys.stdout = open(os.devnull, "w")  # Python flushes stdout again at exit
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line and exit 2, like every other bad input
        print(f"ddpexp: error: report: {message} (usage: ddpexp report PATH [PATH ...])", file=sys.stderr)
        sys.exit(2)
