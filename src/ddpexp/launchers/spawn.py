"""spawn: `gpus` local ranks started with torch.multiprocessing; this process hosts the rendezvous store."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.exceptions import RankFailure
from ddpexp.job import end_process
from ddpexp.launchers.base import Handle, Started, check_resolves, local_ranks, resolve_local, tail, this_command
from ddpexp.launchers.processes import (
    detach_from_terminal,
    die_with_parent,
    forward_signals,
    has_pidfd,
    stop_signals_blocked,
    terminate,
)
from ddpexp.launchers.world import refuse_inside

SWEEP_PARALLEL = "local"  # its ranks run on this machine: a sweep may run sweep.parallel jobs at once


@dataclass
class SpawnConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.spawn.launch"
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # null: a free port, bound by this process (no race between jobs)
    inline_single: bool = True  # gpus=1 runs in this process, without spawning
    # forkserver: one server process imports torch and ddpexp once, and each rank is forked from it (the ranks'
    # start-up CPU is paid once, not once a rank); spawn: each rank a fresh interpreter that imports them itself.
    start_method: str = "forkserver"

    def __post_init__(self) -> None:
        check(
            self.start_method in ("forkserver", "spawn"),
            f"launcher.start_method={self.start_method}: must be forkserver or spawn",
        )
        check(
            self.master_port is None or 0 <= self.master_port <= 65535,
            f"launcher.master_port={self.master_port}: must be a port 0..65535 (0 or null: a free one)",
        )

    def check_hosts(self) -> None:
        check_resolves("launcher.master_addr", self.master_addr)


def resolve(cfg: Any) -> None:
    """Device and ranks from the GPUs visible here; the master address must resolve."""
    refuse_inside("spawn")
    resolve_local(cfg)
    cfg.launcher.check_hosts()


def world_size(config: dict[str, Any]) -> int | None:
    """`gpus` ranks, all on this machine."""
    return config.get("gpus")


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Handle:
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    n, lc = cfg.gpus, cfg.launcher
    # Hosting the store here on port 0 means the port is bound before any rank needs it, so concurrent jobs
    # cannot pick the same one; ranks join as clients (the same mechanism torchrun's agent uses).
    store = TCPStore(lc.master_addr, lc.master_port or 0, is_master=True, wait_for_workers=False)
    env = {
        "MASTER_ADDR": lc.master_addr,
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if n == 1 and lc.inline_single:  # the rank is this process: it runs when the parent waits
        return Started(partial(_join, mp, store, partial(_run_inline, worker, cfg, job, env)))
    # Ranks start with SIGINT/SIGTERM blocked (processes.stop_signals_blocked), then leave the terminal's group
    # (processes.detach_from_terminal); from here until they are joined, this process hands the user's first
    # Ctrl-C/SIGTERM on to them, the same signal (processes.forward_signals), also one that came while they started.
    forwarding = forward_signals().__enter__()
    method = _start_method(lc.start_method)
    # Through the forkserver the ranks inherit the server's environment and CPU affinity, not this process's
    # now: both go with the ranks' arguments, as a spawned process would inherit them.
    inherited = (dict(os.environ), sorted(os.sched_getaffinity(0))) if method == "forkserver" else None
    try:
        with stop_signals_blocked():  # the forkserver, started in here, keeps them blocked too: never stopped by them
            ctx = mp.start_processes(
                _spawned_rank, args=(worker, cfg, job, env, inherited), nprocs=n, join=False, start_method=method
            )
    except BaseException:
        forwarding.__exit__()
        raise
    forwarding.to(partial(terminate, ctx.pids()))
    return Started(partial(_join, mp, store, partial(_join_ranks, ctx), forwarding))


def _join(mp: Any, store: Any, join: Callable[[], None], forwarding: forward_signals | None = None) -> None:
    """The handle's wait: a rank's failure as RankFailure. `store` is held until every rank is done."""
    try:
        join()
    except mp.ProcessRaisedException as e:
        raise RankFailure(e.error_index, tail(e.msg.split("error:", 1)[-1])) from None
    except mp.ProcessExitedException as e:  # it ended without raising: by a signal (died), or an exit code
        if e.exit_code < 0:
            raise RankFailure.by_signal(e.error_index, -e.exit_code) from None
        raise RankFailure(e.error_index, f"exited with code {e.exit_code}") from None
    finally:
        if forwarding is not None:
            forwarding.__exit__()


def _join_ranks(ctx: Any) -> None:
    try:
        # A failed rank: the others get GRACE_S to fail on their own (gloo sees the peer go), then SIGTERM/KILL.
        while not ctx.join(timeout=0.5, grace_period=GRACE_S):
            pass
    except KeyboardInterrupt:  # a second Ctrl-C: at once (multiprocessing would join the ranks at exit)
        for process in ctx.processes:
            process.kill()
        raise


GRACE_S = 5.0


def _start_method(asked: str) -> str:
    """`asked`, where this platform has it (no forkserver on Windows, no pidfd before Linux 5.3); the forkserver
    preloads what every rank imports (torch, torch._dynamo that DDP imports, the rank's worker)."""
    if asked != "forkserver" or "forkserver" not in multiprocessing.get_all_start_methods() or not has_pidfd():
        return "spawn"  # a forked rank watches the command through a pidfd (processes.die_with_parent)
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "ddpexp.rank.worker"])
    return asked


def _run_rank(local_rank: int, worker: Callable[..., None], cfg: Any, job: Any, env: dict[str, str]) -> None:
    detach_from_terminal()
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    worker(cfg, job)


def _spawned_rank(
    local_rank: int, worker: Callable[..., None], cfg: Any, job: Any, env: dict[str, str],
    inherited: tuple[dict[str, str], list[int]] | None = None,
) -> None:  # fmt: skip
    """A rank in a process of its own: once it is done (its record written, its process group closed), the
    process ends at once (job.end_process); a failure leaves through torch.multiprocessing's own report.
    `inherited`: the command's environment and CPU affinity at launch (a rank forked by the forkserver)."""
    die_with_parent(through_forkserver=inherited is not None)
    if inherited is not None:
        environ, cores = inherited
        os.environ.clear()
        os.environ.update(environ)
        os.sched_setaffinity(0, cores)
    _run_rank(local_rank, worker, cfg, job, env)
    end_process(0)


def _run_inline(worker: Callable[..., None], cfg: Any, job: Any, env: dict[str, str]) -> None:
    import traceback

    saved = dict(os.environ)
    try:
        _run_rank(0, worker, cfg, job, env)  # this process's own: no die_with_parent
    except Exception:  # the same report as a spawned rank's failure
        raise RankFailure(0, tail(traceback.format_exc())) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    port = str(cfg.launcher.master_port or "<free port bound at launch>")
    how = (
        "in this process"
        if cfg.gpus == 1 and cfg.launcher.inline_single
        else f"torch.multiprocessing ({cfg.launcher.start_method})"
    )
    ranks = local_ranks(cfg, 0, cfg.gpus, (cfg.launcher.master_addr, port))
    return {"command": f"{this_command(job)}  -> {how} -> ddpexp.rank.worker.main", "ranks": ranks}
