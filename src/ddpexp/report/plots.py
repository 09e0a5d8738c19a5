"""The report's PNGs (matplotlib, Agg): every job's train/loss and objective curves in one figure, and the objective
against each swept parameter. A job keeps its colour in both; jobs that did not complete are drawn dashed/grey."""

from __future__ import annotations

import math
import os
from typing import Any

MAX_LEGEND = 16  # past this many jobs a per-job legend is unreadable: the best and the failed only


def write_all(out_dir: str, r: dict[str, Any]) -> list[str]:
    """Write the plots that have data; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window, works without a display
    written = []
    if any(k in row for j in r["jobs"] for row in j.rows for k in curve_metrics(r)):
        curves(os.path.join(out_dir, "report_curves.png"), r)
        written.append("report_curves.png")
    if r["swept"] and len(r["jobs"]) > 1:  # one job: nothing to compare
        objective(os.path.join(out_dir, "report_objective.png"), r)
        written.append("report_objective.png")
    return written


def curve_metrics(r: dict[str, Any]) -> list[str]:
    """train/loss, and the objective when it is a val metric, else the first val metric the jobs logged."""
    vals = [m for m in r["metrics"] if m.startswith("val/")]
    second = r["objective"] if r["objective"].startswith("val/") else (vals[0] if vals else None)
    return ["train/loss", *([second] if second else [])]


def short_keys(keys: list[str]) -> dict[str, str]:
    """optimizer.lr -> lr, unless two swept keys end alike."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: s if last.count(s) == 1 else k for k, s in zip(keys, last)}


def label(job: Any, r: dict[str, Any]) -> str:
    from ddpexp.report.records import fmt_param

    names = short_keys(r["swept"])
    params = ", ".join(f"{names[k]}={fmt_param(job.overrides[k])}" for k in r["swept"] if k in job.overrides)
    state = "" if job.status == "completed" else f" [{job.status}]"
    return f"job {job.name}: {params}{state}" if params else f"job {job.name}{state}"


def colours(n: int) -> list[Any]:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def curves(path: str, r: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    fig = curves_figure(r)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curves_figure(r: dict[str, Any]) -> Any:
    """The best job (first, as sorted by the objective's direction) drawn bold."""
    import matplotlib.pyplot as plt

    jobs = r["jobs"]
    metrics = curve_metrics(r)
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 4.2), layout="constrained", squeeze=False)
    axes = list(axes.flat)
    for ax, metric in zip(axes, metrics):
        for job, colour in zip(jobs, colours(len(jobs))):
            # A NaN is null in the record (strict JSON): no point there.
            points = [(row["step"], row[metric]) for row in job.rows if row.get(metric) is not None and "step" in row]
            if not points:
                continue
            x, y = zip(*points)
            done = job.status == "completed"
            ax.plot(x, y, color=colour, linestyle="-" if done else "--", marker="o" if metric.startswith("val/") else
                    None, markersize=4, linewidth=2.2 if job is jobs[0] and done and r["direction"] != "unknown" else 1.4, label=label(job, r))  # fmt: skip
            if not done:
                ax.plot(x[-1], y[-1], marker="X", color=colour, markersize=8, linestyle="none")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(metric)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    handles, labels = _unique_handles(axes)
    if len(handles) > MAX_LEGEND:
        handles, labels = handles[:MAX_LEGEND], labels[:MAX_LEGEND]
        labels[-1] += f"  (+{len(jobs) - MAX_LEGEND} more jobs)"
    fig.legend(handles, labels, loc="outside lower center", ncol=2 if len(handles) > 4 else 1, fontsize=8,
               frameon=False, title=f"jobs, best {r['objective']} first (X: stopped there)", title_fontsize=8)  # fmt: skip
    fig.suptitle(f"{len(jobs)} job(s) in {os.path.basename(r['out_dir'])}", fontsize=10)
    return fig


def objective(path: str, r: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    fig = objective_figure(r)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def objective_figure(r: dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt

    from ddpexp.report.records import fmt_param, objective_value

    jobs, swept, name = r["jobs"], r["swept"], r["objective"]
    ncols = min(3, len(swept))
    nrows = math.ceil(len(swept) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows + 0.8), layout="constrained",
                             squeeze=False)  # fmt: skip
    values = [objective_value(j, name) for j in jobs]
    best = 0 if values and values[0] is not None and r["direction"] != "unknown" else None
    lo, hi = _value_range(values)
    for ax, key in zip(axes.flat, swept):
        xs, categories = _positions([j.overrides.get(key) for j in jobs])
        if categories is not None:
            xs = _spread(xs)
        if None in values:  # a grey band under the values holds the jobs without one, apart from them
            ax.set_ylim(lo - 0.3 * (hi - lo), hi + 0.08 * (hi - lo))
            ax.axhspan(lo - 0.3 * (hi - lo), lo - 0.12 * (hi - lo), color="0.92", zorder=0)
        else:
            ax.set_ylim(lo - 0.08 * (hi - lo), hi + 0.08 * (hi - lo))
        for i, (job, x, y, colour) in enumerate(zip(jobs, xs, values, colours(len(jobs)))):
            if y is None:
                ax.plot(x, lo - 0.21 * (hi - lo), marker="x", color="0.35", markersize=8, mew=2, linestyle="none",
                        label="no value (failed or unfinished)")  # fmt: skip
            else:
                ax.plot(x, y, marker="*" if i == best else "o", markersize=14 if i == best else 7, color=colour,
                        markeredgecolor="black", linestyle="none", label=f"job {job.name}")  # fmt: skip
        if categories is not None:
            ax.set_xticks(range(len(categories)), [fmt_param(c) if c is not None else "unset" for c in categories])
            ax.set_xlim(-0.5, len(categories) - 0.5)
        elif _log_scale(xs):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    spare = list(axes.flat)[len(swept) :]
    for ax in spare:
        ax.axis("off")
    handles, labels = _unique_handles(list(axes.flat))
    if len(jobs) > MAX_LEGEND:  # colours alone: keep the best and the failed
        keep = [i for i, lab in enumerate(labels) if lab.startswith("no value") or (best is not None and lab ==
                f"job {jobs[best].name}")]  # fmt: skip
        handles, labels = [handles[i] for i in keep], [labels[i] for i in keep]
    if spare:  # an empty panel of the grid holds the legend
        spare[0].legend(handles, labels, loc="center", fontsize=8, frameon=False)
    else:
        # Below the panels: beside them, the legend ran into the title (constrained layout leaves it the top).
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    direction = r["direction"]
    fig.suptitle(f"{name} ({direction}) vs each swept parameter; star: best job", fontsize=10)
    return fig


def _positions(raw: list[str | None]) -> tuple[list[float], list[str | None] | None]:
    """Numbers stay numbers; anything else (and a parameter some jobs lack, or few integer values such as a
    batch size) becomes evenly spaced categories in sorted order."""
    numbers: list[float] = []
    for v in raw:
        try:
            numbers.append(float(v))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            break
    else:
        if not (all(n.is_integer() for n in numbers) and len(set(numbers)) <= 6):
            return numbers, None
        order = sorted(set(numbers))
        return [float(order.index(n)) for n in numbers], [fmt_int(n) for n in order]
    present = sorted({v for v in raw if v is not None})
    categories: list[str | None] = [*present, *([None] if None in raw else [])]
    return [float(categories.index(v)) for v in raw], categories


def _spread(xs: list[float]) -> list[float]:
    """Jobs in the same category side by side, in job order (best first), instead of on top of each other."""
    out, seen = [], {x: 0 for x in xs}
    for x in xs:
        n = xs.count(x)
        step = min(0.07, 0.5 / n)
        out.append(x + (seen[x] - (n - 1) / 2) * step)
        seen[x] += 1
    return out


def fmt_int(n: float) -> str:
    return str(int(n))


def _value_range(values: list[float | None]) -> tuple[float, float]:
    """The objective's range, widened when it is one value (or none) so the axis still has a height."""
    present = [v for v in values if v is not None] or [0.0]
    lo, hi = min(present), max(present)
    pad = 0.0 if hi > lo else max(abs(hi) * 0.05, 1e-3)
    return lo - pad, hi + pad


def _log_scale(xs: list[float]) -> bool:
    return min(xs) > 0 and max(xs) / min(xs) >= 20


def _unique_handles(axes: Any) -> tuple[list[Any], list[str]]:
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    return handles, labels
