"""slurm: one Slurm job per experiment through submitit, one task per rank; env:// comes from Slurm's variables."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.exceptions import ConfigError, RankFailure
from ddpexp.launchers.base import Handle, tail
from ddpexp.launchers.world import slurm_port

SWEEP_PARALLEL = "scheduler"  # each job is a Slurm job: a sweep's jobs run at once already, as Slurm places them


@dataclass
class SlurmConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.slurm.launch"
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

        dist = TorchDistributedEnvironment()
        if "MASTER_PORT" not in os.environ:  # not submitit's draw from 20000-60000 (world.slurm_port says why)
            dist.master_port = slurm_port(os.environ)
        # Every GPU of the node stays visible: each rank picks cuda:LOCAL_RANK, as under spawn and torchrun.
        dist.export(set_cuda_visible_devices=False)
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


def resolve(cfg: Any) -> None:
    """Pin `device` (and `gpus`) from what Slurm says the partition's nodes have, sinfo's GRES: with device=auto,
    nodes without GPUs run CPU ranks (asked for GPUs there, sbatch refuses: "Invalid generic resource")."""
    _submitit()
    # plan=true too: submitit writes its sbatch script only where Slurm is (it looks for srun)
    if shutil.which("sbatch") is None:
        raise ConfigError("launcher=slurm: sbatch not found on PATH; run this on a Slurm login node")
    if cfg.device == "auto" and cfg.launcher.gpus_per_node == 0:  # asks for no GPUs: CPU ranks
        cfg.device = "cpu"
    if cfg.device != "cpu":
        pin_gpus(cfg)
    if cfg.device == "cpu" and cfg.gpus is None:  # CPU ranks: 2 per node, as the local launchers run
        cfg.gpus = 2


def pin_gpus(cfg: Any) -> None:
    """device=auto or cuda: CUDA ranks where the partition's nodes have GPUs; auto on nodes without: CPU ranks."""
    try:
        partition, gpus = node_gpus(cfg.launcher.partition)
    except ConfigError as e:
        check(
            cfg.device == "cuda",
            f"launcher=slurm, device=auto: sinfo cannot tell whether the nodes have GPUs ({e}); "
            "set device=cpu or device=cuda",
        )
        return  # device=cuda: sbatch has the last word
    check(bool(gpus), f"launcher.partition={partition!r}: Slurm has no such partition (sinfo lists none)")
    if max(gpus) == 0:
        check(
            cfg.device == "auto",
            f"device=cuda: the nodes of Slurm partition {partition!r} have no GPUs (sinfo's GRES); use "
            "device=cpu or another launcher.partition",
        )
        cfg.device = "cpu"
        return
    cfg.device = "cuda"
    if cfg.gpus is None and len(set(gpus) - {0}) == 1:  # every GPU node has as many: all of them, as spawn does
        cfg.gpus = max(gpus)


def node_gpus(partition: str | None) -> tuple[str | None, list[int]]:
    """The partition (none: the default one) and its GPUs per node, for each group of nodes sinfo lists there;
    [] for a partition Slurm does not have. ConfigError with sinfo's reason when it cannot answer."""
    command = ["sinfo", "--noheader", "--format=%P|%G", *([f"--partition={partition}"] if partition else [])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(str(e)) from None
    if done.returncode != 0:
        raise ConfigError(slurm_reason(done.stderr))
    rows = [line.split("|", 1) for line in done.stdout.splitlines() if "|" in line]
    if not partition:  # sinfo marks the default partition: `debug*`
        rows = [row for row in rows if row[0].endswith("*")] or rows
    return (rows[0][0].rstrip("*") if rows else partition), [gres_gpus(gres) for _, gres in rows]


def gres_gpus(gres: str) -> int:
    """The GPUs in one sinfo GRES field: `(null)`, `gpu:4`, `gpu:a100:4(S:0-1)`, `gpu:a100:2,gpu:v100:2,mps:200`."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def _submitit() -> Any:
    try:
        import submitit
    except ImportError as e:
        raise ConfigError("launcher=slurm needs submitit: pip install submitit") from e
    return submitit


def world_size(config: dict[str, Any]) -> int | None:
    """`gpus` tasks on each of `launcher.nodes` nodes."""
    gpus = config.get("gpus")
    return gpus * config.get("launcher", {}).get("nodes", 1) if gpus is not None else None


def executor(cfg: Any, job: Any) -> Any:
    submitit = _submitit()
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


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Handle:
    from submitit.core.utils import FailedJobError

    ex = executor(cfg, job)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's stderr, then raises it: say it once
            sjob = ex.submit(SlurmTask(worker, cfg, job))
    except FailedJobError as e:  # sbatch refused the job: show Slurm's own words
        raise ConfigError(f"sbatch refused the job: {slurm_reason(str(e))}") from None
    sys.stderr.write(said.getvalue())
    print(f"ddpexp: submitted Slurm job {sjob.job_id} ({cfg.launcher.nodes} node(s) x {cfg.gpus} tasks); "
          f"logs in {sjob.paths.folder}", flush=True)  # fmt: skip
    return Waiter(sjob, cfg.launcher.poll_interval_s, follow=cfg.launcher.wait)


def slurm_reason(stderr: str) -> str:
    """A Slurm command's reason in one line: its `fatal:` line; else its first `error:` line (the cause, e.g.
    `invalid partition specified: nope`) and, when there are more, the last (`Batch job submission failed: ...`)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [(line, line.partition(": ")[2]) for line in lines]  # ("sbatch: error: x", "error: x")
    fatal = [line for line, what in said if what.startswith("fatal:")]
    if fatal:
        return fatal[-1]
    errors = [(line, what) for line, what in said if what.startswith("error:")]
    if not errors:
        return lines[-1] if lines else "no message"
    return errors[0][0] if len(errors) == 1 else f"{errors[0][0]}; {errors[-1][1]}"


def killed_task(srun_stderr: str) -> RankFailure | None:
    """The first task that srun says a signal ended (`srun: error: node1: task 1: Killed`, `tasks 0-1: Segmentation
    fault (core dumped)`: strsignal's words, in the batch script's stderr) as its rank's failure; None if none."""
    names = {signal.strsignal(s): s for s in signal.Signals}
    for m in re.finditer(r"^srun: error: \S+: tasks? (\d+)[\d,\-]*: (.+?)(?: \(core dumped\))?$", srun_stderr, re.M):
        if m.group(2) in names:
            return RankFailure.by_signal(int(m.group(1)), names[m.group(2)])
    return None


def _read(path: Any) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


class Waiter:
    """The Handle of a submitted job: `wait` follows it, printing rank 0's new log lines, then raises RankFailure
    if any task failed. With launcher.wait=false it returns at once: the job goes on in Slurm's hands."""

    queued = True  # a sweep submits every job before waiting for any

    def __init__(self, sjob: Any, poll_interval_s: float, follow: bool = True):
        self.sjob, self.poll_interval_s, self.follow = sjob, poll_interval_s, follow

    def wait(self) -> None:
        if not self.follow:
            return
        from ddpexp.launchers.processes import forward_signals

        try:
            with forward_signals(lambda signum: self._scancel("--signal=TERM")):
                self._follow()
        except KeyboardInterrupt:
            self._scancel()
            raise
        try:
            self.sjob.results()
        except Exception as e:  # submitit: FailedJobError / UncompletedJobError with the task's trace
            state = self.sjob.get_info().get("State", self.sjob.state)
            print(f"ddpexp: Slurm job {self.sjob.job_id} ended {state}; logs in {self.sjob.paths.folder}", flush=True)
            killed = killed_task(_read(self.sjob.paths.stderr))  # its peers' errors are echoes of its going
            if killed is not None:
                raise killed from None
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
