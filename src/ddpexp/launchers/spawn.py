"""spawn: `gpus` local ranks started with torch.multiprocessing; this process hosts the rendezvous store."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.faults import detach_from_terminal, die_with_parent, forward_signals, stop_signals_blocked, terminate
from ddpexp.launchers import RankFailure, check_resolves, resolve_local, tail


@dataclass
class SpawnConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.spawn.launch"
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # null: a free port, bound by this process (no race between jobs)
    inline_single: bool = True  # gpus=1 runs in this process, without spawning

    def __post_init__(self) -> None:
        check(
            self.master_port is None or 0 <= self.master_port <= 65535,
            f"launcher.master_port={self.master_port}: must be a port 0..65535 (0 or null: a free one)",
        )

    def check_hosts(self) -> None:
        check_resolves("launcher.master_addr", self.master_addr)


def resolve(cfg: Any) -> None:
    """Device and ranks from the GPUs visible here; the master address must resolve."""
    resolve_local(cfg)
    cfg.launcher.check_hosts()


def world_size(config: dict[str, Any]) -> int | None:
    """`gpus` ranks, all on this machine."""
    return config.get("gpus")


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> None:
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
    try:
        if n == 1 and lc.inline_single:
            _run_inline(worker, cfg, job, env)
        else:
            _start_and_join(mp, n, (worker, cfg, job, env))
    except mp.ProcessRaisedException as e:
        raise RankFailure(e.error_index, tail(e.msg.split("error:", 1)[-1])) from None
    except mp.ProcessExitedException as e:
        raise RankFailure(e.error_index, f"exited with code {e.exit_code}") from None
    finally:
        del store


def _start_and_join(mp: Any, n: int, args: tuple) -> None:
    """Ranks start with SIGINT/SIGTERM blocked (faults.stop_signals_blocked), then leave the terminal's group
    (faults.detach_from_terminal); this process hands the user's first Ctrl-C/SIGTERM on to them, the same signal
    (faults.forward_signals), also one that came while they started."""
    with forward_signals() as forwarding:
        with stop_signals_blocked():
            ctx = mp.start_processes(_run_rank, args=args, nprocs=n, join=False, start_method="spawn")
        forwarding.to(partial(terminate, ctx.pids()))
        try:
            # A failed rank: the others get GRACE_S to fail on their own (gloo sees the peer go), then SIGTERM/KILL.
            while not ctx.join(timeout=0.5, grace_period=GRACE_S):
                pass
        except KeyboardInterrupt:  # a second Ctrl-C: at once (multiprocessing would join the ranks at exit)
            for process in ctx.processes:
                process.kill()
            raise


GRACE_S = 5.0


def _run_rank(local_rank: int, worker: Callable[..., None], cfg: Any, job: Any, env: dict[str, str]) -> None:
    die_with_parent()
    detach_from_terminal()
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    worker(cfg, job)


def _run_inline(worker: Callable[..., None], cfg: Any, job: Any, env: dict[str, str]) -> None:
    import traceback

    saved = dict(os.environ)
    try:
        _run_rank(0, worker, cfg, job, env)
    except Exception:  # the same report as a spawned rank's failure
        raise RankFailure(0, tail(traceback.format_exc())) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    from ddpexp.plan import local_ranks, this_command

    port = str(cfg.launcher.master_port or "<free port bound at launch>")
    how = "in this process" if cfg.gpus == 1 and cfg.launcher.inline_single else "torch.multiprocessing spawn"
    ranks = local_ranks(cfg, 0, cfg.gpus, (cfg.launcher.master_addr, port))
    return {"command": f"{this_command(job)}  -> {how} -> ddpexp.worker.main", "ranks": ranks}
