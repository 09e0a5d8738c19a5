"""slurm: one Slurm job per experiment through submitit, one task per rank; env:// comes from Slurm's variables."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ddpexp.config import ConfigError, LauncherConfig, check
from ddpexp.launchers import RankFailure, tail


@dataclass
class SlurmConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.slurm.launch"
    local: ClassVar[bool] = False
    nodes: int = 1  # tasks per node = gpus
    gpus_per_node: int | None = None  # null: gpus, unless device=cpu (then none)
    cpus_per_task: int = 1
    mem_gb: float | None = None
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    job_name: str = "ddpexp"
    sbatch: dict[str, Any] = field(default_factory=dict)  # more #SBATCH options, e.g. {mail-type: END}
    setup: list[str] = field(default_factory=list)  # shell lines before the tasks start (module load ...)
    signal: str = "USR2"  # sent `signal_delay_s` before the time limit (or on preemption): checkpoint, requeue
    signal_delay_s: int = 90
    wait: bool = True  # follow rank 0's log until the job ends; false: print the job id and return
    poll_interval_s: float = 2.0

    def __post_init__(self) -> None:
        check(self.nodes >= 1, f"launcher.nodes={self.nodes}: must be >= 1")
        check(self.time_min >= 1, f"launcher.time_min={self.time_min}: must be >= 1")
        check(self.cpus_per_task >= 1, f"launcher.cpus_per_task={self.cpus_per_task}: must be >= 1")
        check(
            self.gpus_per_node is None or self.gpus_per_node >= 0,
            f"launcher.gpus_per_node={self.gpus_per_node}: must be >= 0 or null "
            "(null: one GPU per rank, none with device=cpu)",
        )
        check(
            self.mem_gb is None or self.mem_gb * 1024 >= 1,
            f"launcher.mem_gb={self.mem_gb}: must be > 0 (at least 1 MiB) or null (null: Slurm's default)",
        )
        # Slurm sends the signal this long before the time limit; a delay >= the limit signals (checkpoint,
        # requeue) as soon as the job starts, every time it starts.
        limit = min(self.time_min * 60, 65536)  # Slurm takes at most 65535
        check(
            0 <= self.signal_delay_s < limit,
            f"launcher.signal_delay_s={self.signal_delay_s}: must be 0..{limit - 1}, under the job's time limit "
            f"(launcher.time_min={self.time_min})",
        )
        check(self.poll_interval_s > 0, f"launcher.poll_interval_s={self.poll_interval_s}: must be > 0")
        check(bool(self.job_name.strip()), f"launcher.job_name={self.job_name!r}: must not be empty")
        check(
            hasattr(signal, f"SIG{self.signal}") and self.signal not in ("INT", "TERM", "KILL"),
            f"launcher.signal={self.signal!r}: must be a signal name without SIG (USR2, USR1, ...), not INT/TERM/KILL",
        )


class SlurmTask:
    """What submitit pickles: each Slurm task (one per rank) exports env:// from Slurm's variables, then trains."""

    def __init__(self, worker: Callable[..., None], cfg: Any, job: Any):
        self.worker, self.cfg, self.job = worker, cfg, job

    def __call__(self) -> None:
        from submitit.helpers import TorchDistributedEnvironment

        # Every GPU of the node stays visible: each rank picks cuda:LOCAL_RANK, as under spawn and torchrun.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        # A Slurm task stays in its step's process group (slurmstepd tracks it there): no detaching here.
        # The worker takes the signal as "checkpoint, then requeue": the requeued job runs this again and resumes
        # from the job dir. (It replaces submitit's own handler, which would requeue unsaved.)
        job = replace(
            self.job,
            restarts=int(os.environ.get("SLURM_RESTART_COUNT", 0)),
            requeue_signal=self.cfg.launcher.signal,
            requeue=requeue,
            record={"slurm": {k: os.environ.get(f"SLURM_{k.upper()}") for k in ("job_id", "job_nodelist", "ntasks")}},
        )
        self.worker(self.cfg, job)


def requeue() -> bool:
    """Put this job back in the queue (same job id, same job dir: it resumes from the checkpoint)."""
    import logging

    log = logging.getLogger("ddpexp")
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID"))
    if job_id and "SLURM_ARRAY_TASK_ID" in os.environ:
        job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if not job_id:
        return False
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if done.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, done.stderr.strip())
        return False
    log.warning("requeued Slurm job %s; it resumes from the checkpoint", job_id)
    return True


def executor(cfg: Any, job: Any) -> Any:
    try:
        import submitit
    except ImportError as e:
        raise ConfigError("launcher=slurm needs submitit: pip install submitit") from e
    lc = cfg.launcher
    check(cfg.gpus is not None, "launcher=slurm: set gpus=N, the ranks (Slurm tasks) per node")
    gpus_per_node = lc.gpus_per_node if lc.gpus_per_node is not None else (0 if cfg.device == "cpu" else cfg.gpus)
    check(
        gpus_per_node in (0, cfg.gpus),
        f"launcher.gpus_per_node={gpus_per_node} but gpus={cfg.gpus} ranks per node: each rank drives one GPU, "
        f"set gpus={gpus_per_node} (or launcher.gpus_per_node=0 with device=cpu)",
    )
    ex = submitit.SlurmExecutor(folder=os.path.join(job.dir, "submitit"), max_num_timeout=0)
    params = dict(nodes=lc.nodes, ntasks_per_node=cfg.gpus, cpus_per_task=lc.cpus_per_task, time=lc.time_min)
    params.update(signal_delay_s=lc.signal_delay_s)
    params["additional_parameters"] = {"signal": f"{lc.signal}@{lc.signal_delay_s}", **lc.sbatch}
    params.update(job_name=lc.job_name, setup=list(lc.setup))
    params.update(
        {k: getattr(lc, k) for k in ("partition", "account", "qos", "constraint", "exclude") if getattr(lc, k)}
    )
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if lc.mem_gb:
        params["mem"] = f"{int(lc.mem_gb * 1024)}M"
    ex.update_parameters(**params)
    return ex


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Waiter | None:
    if shutil.which("sbatch") is None:
        raise ConfigError("launcher=slurm: sbatch not found on PATH; run this on a Slurm login node")
    from submitit.core.utils import FailedJobError

    ex = executor(cfg, job)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's stderr, then raises it: say it once
            sjob = ex.submit(SlurmTask(worker, cfg, job))
    except FailedJobError as e:  # sbatch refused the job: show Slurm's own words
        raise ConfigError(f"sbatch refused the job: {sbatch_refusal(str(e))}") from None
    sys.stderr.write(said.getvalue())
    print(f"ddpexp: submitted Slurm job {sjob.job_id} ({cfg.launcher.nodes} node(s) x {cfg.gpus} tasks); "
          f"logs in {sjob.paths.folder}", flush=True)  # fmt: skip
    return Waiter(sjob, cfg.launcher.poll_interval_s) if cfg.launcher.wait else None


def sbatch_refusal(stderr: str) -> str:
    """sbatch's reason in one line: its `fatal:` line; else its first `error:` line (the cause, e.g. `invalid
    partition specified: nope`) and, when there are more, the last (`Batch job submission failed: ...`)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = [line for line in lines if line.startswith("sbatch: fatal:")]
    if fatal:
        return fatal[-1]
    errors = [line for line in lines if line.startswith("sbatch: error:")]
    if not errors:
        return lines[-1] if lines else "no message"
    return errors[0] if len(errors) == 1 else f"{errors[0]}; {errors[-1].removeprefix('sbatch: ')}"


class Waiter:
    """Follows a submitted job: prints rank 0's new log lines, then raises RankFailure if any task failed."""

    def __init__(self, sjob: Any, poll_interval_s: float):
        self.sjob, self.poll_interval_s = sjob, poll_interval_s

    def wait(self) -> None:
        from ddpexp.faults import forward_signals

        try:
            with forward_signals(lambda: self._scancel("--signal=TERM")):
                self._follow()
        except KeyboardInterrupt:
            self._scancel()
            raise
        try:
            self.sjob.results()
        except Exception as e:  # submitit: FailedJobError / UncompletedJobError with the task's trace
            state = self.sjob.get_info().get("State", self.sjob.state)
            print(f"ddpexp: Slurm job {self.sjob.job_id} ended {state}; logs in {self.sjob.paths.folder}", flush=True)
            raise RankFailure(f"task of Slurm job {self.sjob.job_id} ({state})", tail(str(e), 30)) from None

    def _scancel(self, *args: str) -> None:
        """Ctrl-C once: SIGTERM to the job's tasks (they checkpoint and stop); twice: cancel the job."""
        subprocess.run(["scancel", *args, str(self.sjob.job_id)], capture_output=True)

    def _follow(self) -> None:
        offset, slurm_done = 0, False
        while not slurm_done:
            # submitit calls a job done once its result file exists; Slurm may still be ending its steps.
            slurm_done = self.sjob.done(force_check=True) and self.sjob.watcher.is_done(self.sjob.job_id, mode="force")
            offset = self._echo(offset)
            if not slurm_done:
                time.sleep(self.poll_interval_s)

    def _echo(self, offset: int) -> int:
        path = self.sjob.paths.stdout
        if not path.exists():
            return offset
        with open(path) as f:
            f.seek(offset)
            sys.stdout.write(f.read())
            sys.stdout.flush()
            return f.tell()


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    """Per task env:// as Slurm will set it, and the exact sbatch script submitit would submit."""
    ex = executor(cfg, job)
    ranks = []
    for node in range(cfg.launcher.nodes):
        for local in range(cfg.gpus):
            ranks.append({"RANK": str(node * cfg.gpus + local), "LOCAL_RANK": str(local),
                          "WORLD_SIZE": str(cfg.launcher.nodes * cfg.gpus), "LOCAL_WORLD_SIZE": str(cfg.gpus),
                          "MASTER_ADDR": "<first host of SLURM_JOB_NODELIST>",
                          "MASTER_PORT": "<derived from SLURM_JOB_ID>"})  # fmt: skip
    script = ex._make_submission_file_text(ex._submitit_command_str, "<submission id>")
    return {
        "command": f"sbatch via submitit (folder {ex.folder}); RANK=SLURM_PROCID, LOCAL_RANK=SLURM_LOCALID",
        "ranks": ranks,
        "script": script,
    }
