"""`ddpexp report` on run records written here, shaped as ddpexp writes them: a sweep whose jobs completed,
failed, were interrupted, killed midway (no summary.json) or never started."""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ddpexp_env
from ddpexp.report.main import main as report_main

# job -> (overrides, summary or None, val/acc per epoch); the metrics rows follow from them
JOBS = {
    "0": (["model=cnn", "optimizer.lr=0.001", "gpus=2"], "completed", [0.71, 0.90]),
    "1": (["model=mlp", "optimizer.lr=0.01", "gpus=2"], "completed", [0.80, 0.95]),
    "2": (["model=cnn", "optimizer.lr=0.1", "gpus=2"], "failed", []),
    "3": (["model=mlp", "optimizer.lr=0.1", "gpus=2"], None, [0.50]),
    "4": (["model=mlp", "optimizer.lr=0.0001", "gpus=2"], None, []),
    "5": (["model=cnn", "optimizer.lr=0.01", "gpus=2"], "interrupted", [0.60]),
    "10": (["model=mlp", "optimizer.lr=0.001", "gpus=2"], "completed", [0.40, 0.80]),
}
ERROR = "rank 1 failed: RuntimeError: debug.fail_at_step=3: rank 1 fails on purpose"
STEPS = 12  # per epoch


def write_job(job: Path, overrides: list[str], status: str | None, accs: list[float]) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"objective": "val/acc", "gpus": 2, "seed": 0}))
    rows = []
    for epoch, acc in enumerate(accs):
        for step in range(epoch * STEPS + 5, (epoch + 1) * STEPS + 1, 5):
            rows.append({"step": step, "epoch": epoch, "train/loss": 2.3 * (1 - acc) + 0.01 * step / STEPS,
                         "lr": 0.001, "samples_per_s": 9000.0})  # fmt: skip
        rows.append({"step": (epoch + 1) * STEPS, "epoch": epoch, "val/loss": 2.0 * (1 - acc), "val/acc": acc})
    if rows or status:
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status is None:
        return
    summary: dict = {"status": status, "launcher": "spawn", "world_size": 2, "device": "cpu", "wall_time_s": 8.25}
    if status == "completed":
        last = {k: v for r in rows for k, v in r.items() if k in ("train/loss", "val/loss", "val/acc")}
        summary.update(final=last, steps=len(accs) * STEPS, epochs=len(accs))
    elif status == "failed":
        summary.update(error=ERROR, error_detail="Traceback (most recent call last):\n  ...")
    else:
        summary.update(signal="SIGTERM", steps=7, checkpoint=str(job / "checkpoints" / "step-00000007.pt"))
    (job / "summary.json").write_text(json.dumps(summary, indent=2))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun" / "2026-12-02" / "10-00-00"
    for name, (overrides, status, accs) in JOBS.items():
        write_job(sweep / name, overrides, status, accs)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": {"max_batch_size": None}}}))
    return sweep


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_a_sweep_is_one_table_best_first_with_every_status(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(sweep)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#  job"))
    assert lines[header].split() == ["#", "job", "model", "optimizer.lr", "status", "val/acc", "val/loss",
                                     "train/loss", "steps", "wall_s", "ranks"]  # fmt: skip
    table = [line.split() for line in lines[header + 2 : header + 2 + len(JOBS)]]
    # completed by val/acc (maximize), then the rest in job order (10 after 5, not after 1)
    assert [(row[1], row[4]) for row in table] == [
        ("1", "completed"), ("0", "completed"), ("10", "completed"),
        ("2", "failed"), ("3", "incomplete"), ("4", "missing"), ("5", "interrupted"),
    ]  # fmt: skip
    assert table[0][:6] == ["1", "1", "mlp", "0.01", "completed", "0.95"]
    counts = "3 completed, 1 failed, 1 incomplete, 1 missing, 1 interrupted"
    assert f"7 job(s): {counts}; objective val/acc (maximize)" in out
    assert "best: job 1, val/acc=0.95" in out and "same in every job: gpus=2" in out
    assert f"job 2 (failed): {ERROR}" in out
    assert "job 3 (incomplete): no summary.json: stopped after step 12" in out
    for name in ("report.md", "report.csv", "report_curves.png", "report_objective.png"):
        assert (sweep / name).stat().st_size > 0, name


def test_csv_holds_full_values_and_errors(sweep: Path) -> None:
    report_main([str(sweep)])
    with open(sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["rank", "job", "dir", "model", "optimizer.lr", "status", "val/acc", "val/loss",
                             "train/loss", "steps", "wall_time_s", "world_size", "error"]  # fmt: skip
    assert [r["job"] for r in rows] == ["1", "0", "10", "2", "3", "4", "5"]
    best = rows[0]
    assert (best["rank"], best["dir"], best["model"], best["optimizer.lr"]) == ("1", str(sweep / "1"), "mlp", "0.01")
    assert float(best["val/acc"]) == 0.95 and float(best["val/loss"]) == pytest.approx(0.1)
    assert (best["steps"], best["wall_time_s"], best["world_size"], best["error"]) == ("24", "8.25", "2", "")
    failed = rows[3]
    assert (failed["status"], failed["error"], failed["val/acc"]) == ("failed", ERROR, "")
    assert float(rows[4]["val/acc"]) == 0.5  # a killed job: the last value its metrics.jsonl saw
    assert rows[5]["status"] == "missing" and rows[5]["val/acc"] == "" and rows[5]["steps"] == ""


def test_markdown_has_the_table_the_failures_and_the_plots(sweep: Path) -> None:
    report_main([str(sweep)])
    md = (sweep / "report.md").read_text()
    columns = ["#", "job", "model", "optimizer.lr", "status", "val/acc", "val/loss", "train/loss", "steps", "wall_s"]
    assert "| " + " | ".join(columns) + " | ranks |" in md
    assert "| 1 | 1 | mlp | 0.01 | completed | 0.95 | 0.1 |" in md
    assert f"- job 2 (failed): {ERROR}" in md and "- job 5 (interrupted)" in md
    assert "![curves](report_curves.png)" in md and "![val/acc vs each swept parameter](report_objective.png)" in md


def test_plots_are_png_files_of_a_readable_size(sweep: Path) -> None:
    import matplotlib.image

    report_main([str(sweep)])
    for name in ("report_curves.png", "report_objective.png"):
        width, height = png_size(sweep / name)
        assert width >= 800 and height >= 400, (name, width, height)
        pixels = matplotlib.image.imread(sweep / name)
        assert pixels.shape[:2] == (height, width) and pixels.std() > 0.05  # decodes, and is not blank


def test_objective_direction_and_the_optuna_result(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = {"name": "optuna", "best_params": {"model": "mlp", "optimizer.lr": 0.01}, "best_value": 0.95}
    (sweep / "optimization_results.yaml").write_text(yaml.safe_dump(results))
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": {"direction": "minimize"}}}))
    report_main([str(sweep)])
    out = capsys.readouterr().out
    assert "objective val/acc (minimize)" in out and "best: job 10, val/acc=0.8" in out
    assert "optuna (optimization_results.yaml): best_value=0.95, model=mlp, optimizer.lr=0.01" in out
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": {"direction": "maximize"}}}))
    report_main([str(sweep), "--objective", "val/loss"])  # the sweeper's direction is val/acc's: loss by its name
    assert "objective val/loss (minimize)" in capsys.readouterr().out
    with open(sweep / "report.csv", newline="") as f:
        assert [r["job"] for r in csv.DictReader(f)][:3] == ["1", "0", "10"]  # lowest val/loss first


def test_several_run_dirs_report_into_their_common_folder(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_main([str(sweep / "0"), str(sweep / "2")])
    out = capsys.readouterr().out
    assert f"in {sweep}" in out and (sweep / "report.csv").exists()
    with open(sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["optimizer.lr"]) for r in rows] == [("0", "completed", "0.001"),
                                                                           ("2", "failed", "0.1")]  # fmt: skip
    assert "model" not in rows[0]  # both cnn: not a swept column
    report_main([str(sweep / "1"), "--out", str(sweep / "elsewhere")])
    assert sorted(p.name for p in (sweep / "elsewhere").iterdir()) == ["report.csv", "report.md", "report_curves.png"]
    with open(sweep / "elsewhere" / "report.csv", newline="") as f:  # one run: its overrides are the columns
        assert [(r["job"], r["model"], r["optimizer.lr"], r["gpus"]) for r in csv.DictReader(f)] == [
            ("1", "mlp", "0.01", "2")
        ]


def test_a_glob_that_matches_an_earlier_report_s_files_reports_again(sweep: Path) -> None:
    """`ddpexp report outputs/DATE/*` twice: the second glob also matches report.csv, report.md and the plots the
    first one wrote there; they are skipped, not taken for missing job dirs."""
    runs = [str(sweep / name) for name in ("0", "1")]
    assert report_main(runs) == 0
    again = sorted(str(p) for p in sweep.iterdir() if p.name in ("0", "1") or p.suffix in (".csv", ".md", ".png"))
    assert len(again) > len(runs)
    assert report_main(again) == 0
    with open(sweep / "report.csv", newline="") as f:
        assert sorted(r["job"] for r in csv.DictReader(f)) == ["0", "1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nowhere"], "ddpexp: error: nowhere: no such directory"),
        (["."], "ddpexp: error: .: neither a job dir nor a multirun dir"),
        ([], "ddpexp: error: report: the following arguments are required: PATH"),
    ],
)
def test_bad_path_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpexp", "report", *args], cwd=tmp_path, env=ddpexp_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith(message) and len(proc.stderr.splitlines()) == 1, proc
    assert proc.stdout == ""


def test_a_job_whose_loss_went_nan_is_reported_failed_and_plotted_without_it(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The record writes a NaN as null (strict JSON): the table and the plots skip it."""
    sweep = tmp_path / "sweep"
    write_job(sweep / "0", ["optimizer.lr=0.001"], "completed", [0.7, 0.9])
    bad = sweep / "1"
    write_job(bad, ["optimizer.lr=1e30"], "failed", [])
    (bad / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "epoch": 0, "train/loss": 2.3})
        + "\n"
        + json.dumps({"step": 2, "epoch": 0, "train/loss": None})
        + "\n"
    )
    error = "rank 0 failed: NonFinite: train/loss went non-finite (nan) at step 2; stopped at step 2"
    summary = json.loads((bad / "summary.json").read_text())
    (bad / "summary.json").write_text(json.dumps({**summary, "error": error, "final": {"train/loss": None}}))
    assert report_main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert f"job 1 (failed): {error}" in out
    assert png_size(sweep / "report_curves.png")[0] > 0 and png_size(sweep / "report_objective.png")[0] > 0


def test_the_objective_plot_keeps_its_legend_off_the_title(sweep: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from ddpexp.report import plots
    from ddpexp.report.main import build

    fig = plots.objective_figure(build([str(sweep)], None, None))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title, legend = fig._suptitle.get_window_extent(renderer), fig.legends[0].get_window_extent(renderer)
    assert not title.overlaps(legend), (title, legend)


def test_the_recorded_mode_sorts_a_user_task_s_own_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user task declares val/bits_per_char minimized (no name could tell: it does not end in loss); its jobs'
    records hold the mode the run resolved from that declaration, and the report sorts, titles and draws by it."""
    import matplotlib

    matplotlib.use("Agg")
    from ddpexp.parts.tasks import directions, objective_mode
    from ddpexp.report import plots
    from ddpexp.report.main import build
    from user_task import BitsPerChar

    mode = objective_mode(BitsPerChar(), "val/bits_per_char", "auto")
    sweep, bits = tmp_path / "sweep", {"0": 2.5, "1": 1.25, "2": 3.0}
    for name, b in bits.items():
        job = sweep / name
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"optimizer.lr=0.0{name}1"]))
        (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"objective": "val/bits_per_char"}))
        final = {"train/loss": b * 0.7, "val/bits_per_char": b, "val/acc": 1 / b}
        rows = [{"step": 5, "epoch": 0, "train/loss": b}, {"step": 10, "epoch": 0, "train/loss": b * 0.7},
                {"step": 10, "epoch": 0, "val/bits_per_char": b, "val/acc": 1 / b}]  # fmt: skip
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"status": "completed", "final": final, "objective": {"name": "val/bits_per_char", "mode": mode},
                   "directions": directions(BitsPerChar()), "steps": 10, "world_size": 1, "wall_time_s": 1.0}  # fmt: skip
        (job / "summary.json").write_text(json.dumps(summary))
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": {"max_batch_size": None}}}))

    assert report_main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "objective val/bits_per_char (minimize)" in out and "best: job 1, val/bits_per_char=1.25" in out
    with open(sweep / "report.csv", newline="") as f:
        assert [r["job"] for r in csv.DictReader(f)] == ["1", "0", "2"]
    r = build([str(sweep)], None, None)
    fig = plots.curves_figure(r)
    widths = {(ax.get_title(), line.get_label()): line.get_linewidth() for ax in fig.axes for line in ax.get_lines()}
    bold = sorted(key for key, width in widths.items() if width > 2)
    assert bold == [("train/loss", "job 1: lr=0.011"), ("val/bits_per_char", "job 1: lr=0.011")], widths
    assert "(minimize)" in plots.objective_figure(r)._suptitle.get_text()

    report_main([str(sweep), "--direction", "maximize"])  # still the override
    assert "best: job 2, val/bits_per_char=3" in capsys.readouterr().out
    for older in (["objective"], ["objective", "directions"]):  # the task's directions; else the name's guess
        for name in bits:
            summary = json.loads((sweep / name / "summary.json").read_text())
            (sweep / name / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k not in older}))
        report_main([str(sweep)])
        expected = "minimize" if older == ["objective"] else "maximize"
        assert f"objective val/bits_per_char ({expected})" in capsys.readouterr().out
