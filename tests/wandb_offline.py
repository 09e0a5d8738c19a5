"""Read offline W&B runs back from disk with wandb's own reader, ``wandb leet inspect``.

wandb 0.31 ships no importable reader for ``run-<id>.wandb`` logs, so this runs its CLI.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_INSPECT_TIMEOUT_S = 120.0
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def find_offline_runs(root: str | Path) -> list[Path]:
    """Return every ``offline-run-*`` directory under ``root``, recursively.

    Sorted by path, i.e. by start time to the second; same-second runs sort by run id.
    """
    found = {p.resolve() for p in Path(root).rglob("offline-run-*") if p.is_dir()}
    return sorted(found)


def _wandb_file(run_dir: Path) -> Path:
    files = sorted(run_dir.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected exactly one run-*.wandb file in {run_dir}, found {len(files)}")
    return files[0]


def _start_inspect(wandb_file: Path, *flags: str) -> subprocess.Popen[str]:
    # WANDB_MODE=offline makes the CLI pass --no-observability to wandb-core, so the
    # reader never tries to upload its own telemetry.
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", *flags, str(wandb_file)]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish_inspect(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=_INSPECT_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: {err.strip()}")
    return out


def _decode_non_finite(value: Any) -> Any:
    """Undo wandb-core's JSON spelling of NaN/inf as "NaN"/"Infinity"/"-Infinity"."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _decode_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_non_finite(v) for v in value]
    return value


def read_offline_run(run_dir: str | Path) -> dict[str, Any]:
    """Read an ``offline-run-*`` directory into a plain dict.

    Returns ``{"id", "project", "group", "name", "config", "history", "summary"}``.
    ``config`` and ``summary`` are wandb's own aggregation (``leet inspect --summary
    --json``, without ``_wandb``); ``history`` has one dict per committed step, in log
    order, each with ``_step`` (the explicit ``step=`` when one was given). Nested dicts
    given to ``wandb.log`` come back with "."-joined keys in history rows
    (``{"m": {"x": 1}}`` -> ``"m.x"``) but nested in ``summary``. ``group`` and ``name``
    are None when unset.
    """
    wandb_file = _wandb_file(Path(run_dir))
    # Two independent reads of one file, run concurrently: each pays ~0.5 s of import.
    procs = [
        _start_inspect(wandb_file, "--json"),
        _start_inspect(wandb_file, "--summary", "--json"),
    ]
    try:
        records_out, overview_out = (_finish_inspect(proc) for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:  # only after a timeout or an error in the other
                proc.kill()
                proc.communicate()
    overview: dict[str, Any] = json.loads(overview_out)

    group: str | None = None
    history: list[dict[str, Any]] = []
    for line in records_out.splitlines():
        if not line.strip():
            continue
        record: dict[str, Any] = json.loads(line)
        kind = record.get("type")
        if kind == "run":
            group = record["run"].get("run_group") or group
        elif kind == "history":
            body = record["history"]
            row = _decode_non_finite(dict(body.get("item", {})))
            row.setdefault("_step", body.get("step", {}).get("num", 0))
            history.append(row)

    if not overview.get("run_id"):
        raise ValueError(
            f"{wandb_file} holds no run record: was the process killed before "
            "wandb-core flushed it? (It buffers the log until run.finish() or exit.)"
        )
    return {
        "id": overview["run_id"],
        "project": overview.get("project") or None,
        "group": group,
        "name": overview.get("name") or None,
        "config": dict(overview.get("config") or {}),
        "history": history,
        "summary": _decode_non_finite(dict(overview.get("summary") or {})),
    }
