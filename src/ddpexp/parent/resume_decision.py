"""The parent's resume decision for one job, before anything starts: a `resume=PATH` to start from, the job dir's own
checkpoint to continue, a job that already completed, or a record of another run that must not be overwritten or
mixed; and whether a checkpoint's config may be resumed under this one (the keys that change results)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from ddpexp.config import Config
from ddpexp.exceptions import ConfigError
from ddpexp.job import Job, read_json
from ddpexp.parent import sweep
from ddpexp.parent.command import Command
from ddpexp.parent.compat import same_hydra_configs, same_run_configs


def check_resume(cfg: Config, job: Job, cmd: Command) -> float | None:
    """Before anything starts: a bad `resume=PATH`, a finished job, or a checkpoint written under a different
    config (one that changes results) each end here, with one line."""
    from ddpexp.rank import checkpoint

    own = checkpoint.find_latest(job.checkpoint_dir) if os.path.isdir(job.checkpoint_dir) else None
    if own is None:
        done = earlier_record(cfg, job, cmd)
        if done is not None:
            return done
    if cfg.resume == "never":
        if own is not None:
            raise ConfigError(
                f"resume=never but {job.dir} holds checkpoints of an earlier run; "
                "use resume=auto to continue it, or another hydra.run.dir"
            )
        return None
    wanted = cfg.resume
    if own is None and wanted == "latest":
        wanted = latest_job_dir(run_root(str(OmegaConf.to_container(HydraConfig.get().run)["dir"])), job.config_yaml)
    source = own or (checkpoint.resolve(wanted) if wanted != "auto" else None)
    if source is None:
        return None
    job.resume_from = None if own else source  # what the ranks start from, unless the job dir has its own by then
    saved = checkpoint.load(source)["config"]
    drift = config_drift(yaml.safe_load(saved), yaml.safe_load(job.config_yaml))
    if drift and not cfg.resume_allow_config_change:
        raise ConfigError(
            f"resume: {source} was trained with a different {', '.join(drift)}; "
            "set resume_allow_config_change=true to resume anyway, or resume=never in a new dir"
        )
    summary = read_json(job.summary_path) or {}
    if own is not None and summary.get("status") == "completed" and saved in same_run_configs(job.config_yaml):
        value = summary.get("final", {}).get(cfg.objective)
        print(f"ddpexp: {job.dir} already completed ({cfg.objective}={value}); nothing to do")
        return value
    if own is not None and cfg.resume not in ("auto", "never"):
        print(f"ddpexp: resuming from {own}, this job's own newest checkpoint (resume={cfg.resume} only starts a job)")
    else:
        latest = " (resume=latest: the newest job dir of this config)" if cfg.resume == "latest" else ""
        print(f"ddpexp: resuming from {source}{latest}", flush=True)
    return None


def run_root(pattern: str) -> str:
    """The folder above a run dir pattern's first `${...}` part: outputs/ for outputs/${now:...}/${now:...}."""
    parts = pattern.split("/")
    fixed = next((i for i, part in enumerate(parts) if "${" in part), len(parts) - 1)
    return "/".join(parts[:fixed]) or "."


def latest_job_dir(root: str, config_yaml: str) -> str:
    """`resume=latest`: the newest job dir under `root` (by its newest step checkpoint) whose checkpoint was
    trained under this config as a resume judges it (no DRIFT_KEYS differ: a longer max_steps or epochs is the
    same run); a checkpoint that does not load is passed over."""
    from ddpexp.exceptions import CheckpointError
    from ddpexp.rank import checkpoint

    found = []
    for folder, dirs, _ in os.walk(root):
        steps = checkpoint.step_files(os.path.join(folder, "checkpoints"))
        if steps:
            found.append((max(os.path.getmtime(f) for f in steps), folder, steps[-1]))
        if os.path.isdir(os.path.join(folder, ".hydra")):
            dirs.clear()  # a job's own folders hold no jobs
    config = yaml.safe_load(config_yaml)
    for _, folder, newest in sorted(found, reverse=True):
        try:
            saved = yaml.safe_load(checkpoint.load(newest)["config"])
        except CheckpointError:
            continue
        if isinstance(saved, dict) and not config_drift(saved, config):
            return os.path.abspath(folder)
    raise ConfigError(
        f"resume=latest: no job dir under {os.path.abspath(root)} holds a checkpoint of this config "
        f"({', '.join(DRIFT_KEYS)} as now); give resume=PATH"
    )


def earlier_record(cfg: Config, job: Job, cmd: Command) -> float | None:
    """A job dir without checkpoints may still hold an earlier attempt's record (summary.json, metrics.jsonl).
    Of this very config: completed, there is nothing to do; else it starts over and the record is redone. Of
    another config (or of none it names): refused, so that no one's results get overwritten or mixed."""
    summary = read_json(job.summary_path)
    trained = os.path.isfile(job.metrics_path) and os.path.getsize(job.metrics_path) > 0
    if summary is None and not trained:
        return None
    recorded = {(summary or {}).get("config_sha256"), *(summary or {}).get("config_sha256_per_rank", [])} - {None}
    # Killed before any summary: Hydra's record of the earlier attempt (.hydra/config.yaml) says which config ran.
    hydra_dir = os.path.join(job.dir, str(HydraConfig.get().output_subdir))
    earlier = cmd.earlier_hydra.get(job.dir, {}).get("config.yaml")
    now = sweep.read_files(hydra_dir).get("config.yaml")
    same_hydra = (
        earlier is not None and now is not None and (earlier == now or _text(earlier) in same_hydra_configs(now))
    )
    same_run = {config_sha256(form) for form in same_run_configs(job.config_yaml)}  # an older release's form too
    if not (recorded and recorded <= same_run) and not (not recorded and same_hydra):
        raise ConfigError(
            f"{job.dir} holds the record of another run (summary.json, metrics.jsonl) and no checkpoint to resume; "
            "use another hydra.run.dir"
        )
    if summary is not None and summary.get("status") == "completed":
        value = summary.get("final", {}).get(cfg.objective)
        print(f"ddpexp: {job.dir} already completed ({cfg.objective}={value}); nothing to do")
        return value
    return None


def _text(data: str | bytes) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def config_sha256(config_yaml: str) -> str:
    return hashlib.sha256(config_yaml.encode()).hexdigest()


# What decides the numbers a run produces; a checkpoint resumed under other values would not be "the same run".
DRIFT_KEYS = ("model", "data", "optimizer", "scheduler", "batch_size", "grad_accum", "seed", "precision",
              "clip_grad_norm", "drop_last", "world_size")  # fmt: skip
DRIFT_DEFAULTS = {"drop_last": False}  # a key added later: an older config without it held this value
NOT_DRIFT = ("data.root", "data.download")


def config_drift(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The result-changing keys that differ between two resolved configs (dotted, sorted)."""

    def flat(cfg: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in DRIFT_KEYS:
            value = world_size(cfg) if key == "world_size" else cfg.get(key, DRIFT_DEFAULTS.get(key))
            stack = [(key, value)]
            while stack:
                k, v = stack.pop()
                if isinstance(v, dict) and v:
                    stack += [(f"{k}.{kk}", vv) for kk, vv in v.items()]
                elif not k.startswith(NOT_DRIFT):
                    out[k] = v
        return out

    a, b = flat(old), flat(new)
    if a["world_size"] is None or b["world_size"] is None:  # an elastic range: the worker checks the real one
        del a["world_size"], b["world_size"]
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def world_size(cfg: dict[str, Any]) -> int | None:
    """Ranks a resolved config asks for, as its launcher counts them (ddpexp.launchers); None when they are known
    only at start (an elastic torchrun range) or the launcher does not say."""
    import importlib

    try:
        launcher = importlib.import_module(str(cfg.get("launcher", {}).get("_target_", "")).rpartition(".")[0])
    except (ImportError, ValueError):  # no launcher named, or one that is gone
        return None
    count = getattr(launcher, "world_size", None)
    return count(cfg) if count else None
