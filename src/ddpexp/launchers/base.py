"""The launcher contract (`Launcher`, `Handle`) and what the launchers that start ranks on this machine share.

A launcher is a module with a `NameConfig` dataclass and four functions; the parent calls, in this order:
`resolve(cfg)` (pin `device` and `gpus`, check what only this machine or the network can tell), `world_size(config)`
(the ranks a resolved config asks for, or None: known only at start), then `plan(cfg, job)` for plan=true, else
`launch(worker, cfg, job)`, which starts the ranks with PyTorch's env:// variables, each calling `worker(cfg, job)`,
and returns a Handle that the parent waits on (submitit's `submit` returns a Job the same way). Optional:
`job_dir(launcher_cfg, proposed)`, when the job dir is not this command's to choose (JobDir); `SWEEP_PARALLEL`, a
module constant: "local" (its ranks run on this machine, so a sweep's `sweep.parallel=N` runs N jobs at once, each
in a child process of the command pinned to its own GPUs or CPU cores: ddpexp.parent.parallel) or "scheduler" (a
sweep's jobs run at once already; `sweep.parallel` is ignored, with a warning). Without it, `sweep.parallel>1` is
refused."""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ddpexp.exceptions import ConfigError


@runtime_checkable
class Handle(Protocol):
    """A started (or submitted) job. `wait()` returns once its ranks ended, raising RankFailure when one failed,
    and Interrupted-like signals are handed on by the launcher meanwhile. `queued`: the job runs on a scheduler's
    resources, so a sweep submits every job before waiting for any; else each job is waited for before the next.
    Optional `reports` (default True): whether this command speaks for the job, its result line and a failure's
    record (when each rank is a command of its own, launcher=env, only rank 0's does)."""

    queued: bool

    def wait(self) -> None: ...


class Launcher(Protocol):
    """What a launcher module provides (a module satisfies this Protocol: its functions are the methods)."""

    def resolve(self, cfg: Any) -> None: ...

    def world_size(self, config: dict[str, Any]) -> int | None: ...

    def plan(self, cfg: Any, job: Any) -> dict[str, Any]: ...

    def launch(self, worker: Callable[..., None], cfg: Any, job: Any) -> Handle: ...


CONTRACT = ("resolve", "world_size", "plan", "launch")


@dataclass
class JobDir:
    """What a launcher's optional `job_dir(launcher_cfg, proposed)` returns, called before Hydra writes anything
    into the dir it proposes: the dir this command's job uses, where each rank is a command of its own that must
    use rank 0's (launcher=env). A `leader` writes the .hydra/ record and holds the job dir's lock; `keep` is kept
    alive until the command ends (env: the store that rank 0 hosts for the ranks' rendezvous)."""

    path: str
    leader: bool = True
    keep: Any = None


class Started:
    """The Handle of a job whose ranks run in this command's processes: `wait` is the given function (it joins
    the ranks, or runs them when they can only run in this thread: torchrun's agent, gpus=1 in-process)."""

    queued = False

    def __init__(self, wait: Callable[[], None], reports: bool = True):
        self.wait, self.reports = wait, reports


def tail(text: str, lines: int = 25) -> str:
    """A rank's traceback, short enough to print, trimmed from the middle: every chained exception's header and
    error lines, the user's own frames (the last ones where they are many) and the frame that raised, while the
    frames of torch, ddpexp, Python and site-packages become one `...` line per run. The last 25 lines alone began
    with a dangling "The above exception was the direct cause" and left out the user's frame and error."""
    all_lines = text.rstrip().splitlines()
    if len(all_lines) <= lines:
        return "\n".join(all_lines)
    sections = _sections(all_lines)
    for user_frames in (None, 3, 1):
        kept = [line for i, section in enumerate(sections)
                for line in _trimmed(section, user_frames, last=i == len(sections) - 1)]  # fmt: skip
        if len(kept) <= lines:
            return "\n".join(kept)
    return "\n".join(kept[:2] + ["  ..."] + kept[-(lines - 3) :])


_FRAME = re.compile(r'  File "(.*)", line \d+')
_CARETS = re.compile(r"\s*[\^~]+\s*")


def _sections(lines: list[str]) -> list[tuple[list[str], list[list[str]], list[str]]]:
    """Each chained exception: (its header lines, its frames, each the File line and the lines under it, its error
    lines), in the traceback's order."""
    sections: list[tuple[list[str], list[list[str]], list[str]]] = [([], [], [])]
    for line in lines:
        head, frames, error = sections[-1]
        if _FRAME.match(line):
            frames.append([line])
        elif line.startswith("    ") and frames and not error:
            frames[-1].append(line)
        elif line.startswith("Traceback (most recent call last):") and (frames or error):
            sections.append(([line], [], []))
        elif frames or error:
            error.append(line)
        else:
            head.append(line)
    for i in range(len(sections) - 1):  # "The above exception ..." introduces the next exception
        error, head = sections[i][2], sections[i + 1][0]
        while error and (not error[-1].strip() or error[-1].startswith(("The above exception", "During handling"))):
            head.insert(0, error.pop())
    return sections


def _trimmed(section: tuple[list[str], list[list[str]], list[str]], user_frames: int | None, last: bool) -> list[str]:
    head, frames, error = section
    mine = [i for i, frame in enumerate(frames) if _is_users(frame[0])]
    keep = set(mine if user_frames is None else mine[-user_frames:])
    if last and frames:
        keep.add(len(frames) - 1)  # where it was raised, whoever's
    out, skipped = list(head), []
    for i, frame in enumerate(frames + [[]]):
        if i < len(frames) and i not in keep:
            skipped.append(i)
            continue
        if skipped:
            whose = "" if set(skipped) & set(mine) else " of torch, ddpexp or other packages"
            out.append(f"  ... {len(skipped)} frame(s){whose}")
            skipped = []
        out.extend(line for line in frame if not _CARETS.fullmatch(line))
    return out + (error if last else error[:3])


def _is_users(file_line: str) -> bool:
    import sysconfig

    match = _FRAME.match(file_line)
    path = match.group(1) if match else ""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/ddpexp, this file is in launchers/
    libraries = (ours + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    parts = path.replace("\\", "/").split("/")
    return not (
        path.startswith("<") or path.startswith(libraries) or "site-packages" in parts or "dist-packages" in parts
        or "torch" in parts
    )  # fmt: skip


def check_resolves(key: str, host: str, shown: str | None = None) -> None:
    """Refuse an address that does not resolve: the ranks would retry the rendezvous there until its timeout.
    Called by `resolve`, in the parent only: building a config does no network look-up."""
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{key}={shown or host!r}: cannot resolve host {host!r} ({why})") from None


def resolve_local(cfg: Any) -> None:
    """Pin `device` and `gpus` for a launcher that starts ranks on this machine, from the GPUs visible here."""
    import torch

    visible = torch.cuda.device_count()
    if cfg.device == "cuda" and visible == 0:
        raise ConfigError("device=cuda: no CUDA GPU is visible here; use device=cpu (or device=auto)")
    cfg.device = cfg.device if cfg.device != "auto" else ("cuda" if visible else "cpu")
    cfg.gpus = cfg.gpus or (visible if cfg.device == "cuda" else 2)
    if cfg.device == "cuda" and cfg.gpus > visible:
        raise ConfigError(f"gpus={cfg.gpus}: only {visible} CUDA GPU(s) visible here; use gpus<={visible}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cfg.device == "cpu" and cfg.gpus > cores:
        # Each rank then gets one thread (speed.limit_threads), and ranks take turns on the cores: allowed (a
        # test of many ranks on a laptop), but slower than it looks.
        print(f"ddpexp: warning: gpus={cfg.gpus} CPU ranks on {cores} core(s) here: the ranks oversubscribe the "
              f"cores; gpus<={cores} gives each rank a core of its own", file=sys.stderr, flush=True)  # fmt: skip


def this_command(job: Any) -> str:
    return " ".join([sys.executable, "-m", "ddpexp", *job.command])


def local_ranks(cfg: Any, node_rank: Any, world_size: Any, master: tuple[str, str]) -> list[dict[str, str]]:
    """env:// per local rank, for a plan; `node_rank` and `world_size` may be formulas known only at rendezvous."""
    ranks = []
    for local in range(cfg.gpus):
        rank = str(local) if node_rank == 0 else f"{node_rank}*{cfg.gpus}+{local}"
        ranks.append({"RANK": rank, "LOCAL_RANK": str(local), "WORLD_SIZE": str(world_size),
                      "LOCAL_WORLD_SIZE": str(cfg.gpus), "MASTER_ADDR": master[0], "MASTER_PORT": master[1]})  # fmt: skip
    return ranks
