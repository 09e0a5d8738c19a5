"""What a launcher and the worker know of the job: its directory, its name in a sweep, the resolved config, and
what the launcher tells the ranks about itself (restarts, a requeue hook, facts for the run record); the strict
JSON and folder helpers every layer's records use; the job dir's lock; partial files of cut-short writes
(remove_partial); how a finished process ends (end_process)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ddpexp.exceptions import ConfigError


@dataclass
class Job:
    dir: str  # absolute; Hydra made it in the parent, ranks only write into it
    name: str  # W&B run name: the job's overrides
    group: str | None  # W&B group: the sweep, None for a single run
    launcher: str  # the `launcher=` choice
    config_yaml: str  # the resolved config, as the checkpoint and W&B store it
    overrides: list[str] = field(default_factory=list)
    config_sha256: str = ""  # of config_yaml, computed once by the parent
    command: list[str] = field(default_factory=list)  # the command line after `ddpexp`: plans and resume hints
    # The parent's resume decision: the checkpoint `resume=PATH` names, when the job dir holds none of its own.
    # The ranks take the job dir's own newest checkpoint when there is one (an elastic restart, a requeue), else this.
    resume_from: str | None = None
    # min or max as a sweeper's `direction` states it: objective_mode=auto takes it where the task declares nothing.
    stated_mode: str | None = None
    # Set by the launcher inside each rank, before it calls the worker: the worker names no launcher.
    restarts: int = 0  # how often this job was started again (an elastic restart, a scheduler's requeue)
    requeue_signal: str | None = None  # a signal that means "checkpoint, then requeue" (e.g. Slurm's USR2)
    requeue: Callable[[], bool] | None = None  # puts the job back in its queue; True when it did
    record: dict[str, Any] = field(default_factory=dict)  # the launcher's facts for summary.json

    @property
    def summary_path(self) -> str:
        return os.path.join(self.dir, "summary.json")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.dir, "metrics.jsonl")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.dir, "checkpoints")

    def log_path(self, rank: int) -> str:
        return os.path.join(self.dir, "logs", f"rank{rank}.log")

    def error_path(self, rank: int) -> str:
        """A failing rank's traceback and time: the earliest one is the root cause, the rest its echoes."""
        return os.path.join(self.dir, "logs", f"rank{rank}.error.json")


def write_json(path: str, obj: Any) -> None:
    """Strict JSON, written atomically: a non-finite float (NaN, inf) is written as null, which every parser reads."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(finite(obj), f, indent=2, default=str, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def finite(obj: Any) -> Any:
    """`obj` with every NaN/inf float replaced by None (JSON has no such numbers; Python's json writes bare NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):  # a path under a file: none either
        return None


def why_not_dir(path: str, error: OSError) -> str:
    """Why a folder could not be made or written: the file in its way, else the OS's words (and the path that
    failed, when it is not `path` itself)."""
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        parents = [path]
        while os.path.dirname(parents[-1]) != parents[-1]:
            parents.append(os.path.dirname(parents[-1]))
        in_the_way = next((p for p in parents if os.path.exists(p) and not os.path.isdir(p)), None)
        if in_the_way:
            return f"{in_the_way} is a file"
    why = error.strerror or str(error)
    if error.filename and os.path.abspath(str(error.filename)) != path:
        why += f" ({error.filename})"
    return why


LOCK = "job.lock"


def take_lock(job_dir: str) -> str | None:
    """Hold `job_dir` for this command (host and pid in JOB_DIR/job.lock): a job dir holds one job at a time. A
    lock whose process is gone (this host's pid no longer runs: a killed command, an elastic restart) is taken
    over; a live one is one line. Returns the lock's path, for `release_lock`; None where the dir cannot be made
    (Hydra's attempt to make it then says why, in one line)."""
    import socket
    import time

    path, me = os.path.join(job_dir, LOCK), {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    try:
        os.makedirs(job_dir, exist_ok=True)
    except OSError:
        return None
    for _ in range(10):  # a few rounds: another command may take over the same stale lock at the same moment
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_json(path) or {}
            if _alive(holder, me["host"]):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
                gone = "" if holder.get("host") == me["host"] else f"; if it is gone, remove {path}"
                raise ConfigError(
                    f"{job_dir}: a job is running there (pid {holder.get('pid')} on {holder.get('host')}, since "
                    f"{since}){gone}; wait for it to end, or give this run another dir"
                ) from None
            try:  # stale: moved aside atomically, so that one taker wins
                os.replace(path, f"{path}.stale.{os.getpid()}")
                os.remove(f"{path}.stale.{os.getpid()}")
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise ConfigError(f"{job_dir}: could not take {path}: other commands keep taking it")


def release_lock(path: str | None) -> None:
    """Remove this command's lock (only if it is still this process's: a stale one may have been taken over)."""
    if path is None:
        return
    holder = read_json(path) or {}
    if holder.get("pid") == os.getpid():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _alive(holder: dict[str, Any], host: str) -> bool:
    """Whether the lock's process still runs. One on another host cannot be asked: taken as alive."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False  # unreadable or half-written by a process that died writing it
    if holder.get("host") != host:
        return True
    if pid == os.getpid():
        return False  # this very process: an earlier job of the same command that never released it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by its parent) holds nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_partial(folders: list[str]) -> list[str]:
    """Remove the partial files of atomic writes cut short (`NAME.tmp.PID`: write_json, checkpoint saves, a sharded
    checkpoint's folder) in `folders` whose writer is gone: its pid no longer runs on this host (a writer killed
    midway, an earlier attempt of this job; this very process holds none between writes). A live writer's file is
    left alone. A whole checkpoint moved aside for its replacement (`NAME.old.tmp.PID`) is put back as NAME when
    the replacement never arrived, else removed. Called at a job's start, with the job dir's lock held (no other command writes there); returns what
    it removed."""
    import re
    import shutil
    import socket

    host, removed = socket.gethostname(), []
    for folder in folders:
        try:
            names = sorted(os.listdir(folder))
        except OSError:  # not made yet
            continue
        for name in names:
            match = re.fullmatch(r".+\.tmp\.(\d+)", name)
            path = os.path.join(folder, name)
            if match is None or not os.path.lexists(path) or _alive({"pid": int(match.group(1)), "host": host}, host):
                continue
            kept = os.path.join(folder, name[: match.start(1) - len(".old.tmp.")])
            if name[: match.start(1)].endswith(".old.tmp.") and not os.path.lexists(kept):
                os.rename(path, kept)  # moved aside for its replacement, which never came: the only whole copy
                continue
            try:
                if os.path.isdir(path) and not os.path.islink(path):  # a sharded checkpoint's folder
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except FileNotFoundError:  # its writer finished (renamed it) after all
                continue
            removed.append(path)
    return removed


def end_process(code: int) -> NoReturn:
    """End this process now that its work is done: its exit handlers run (logging, multiprocessing, W&B) and its
    output is flushed, as at a normal exit, but Python's finalization of every module loaded is skipped. With
    PyTorch loaded that finalization costs 0.4-1 s of each command and of each spawned rank, after all is written.
    A thread still running takes the normal way out, which waits for it (as Python's exit does)."""
    import atexit
    import sys
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`ddpexp ... | head`), or a closed stream
            pass
    os._exit(code)
