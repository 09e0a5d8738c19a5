"""slurm: one Slurm job per experiment through submitit, one task per rank; env:// comes from Slurm's variables."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
        # The worker takes this signal as "checkpoint, then scontrol requeue": the requeued job runs this again
        # and resumes from the job dir. (It replaces submitit's own handler, which would requeue unsaved.)
        os.environ["DDPEXP_REQUEUE_SIGNAL"] = self.cfg.launcher.signal
        self.worker(self.cfg, self.job)


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
        f"set gpus={gpus_per_node} (or gpus_per_node=0 with device=cpu)",
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
    try:
        sjob = ex.submit(SlurmTask(worker, cfg, job))
    except FailedJobError as e:  # sbatch refused the job: show Slurm's own words
        words = [line for line in str(e).splitlines() if line.strip()]
        raise ConfigError(f"sbatch refused the job: {words[0] if words else e}") from None
    print(f"ddpexp: submitted Slurm job {sjob.job_id} ({cfg.launcher.nodes} node(s) x {cfg.gpus} tasks); "
          f"logs in {sjob.paths.folder}", flush=True)  # fmt: skip
    return Waiter(sjob, cfg.launcher.poll_interval_s) if cfg.launcher.wait else None


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
