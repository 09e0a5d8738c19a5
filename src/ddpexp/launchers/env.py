"""env: this command is one rank of a world another launcher started (torchrun, srun, a Kubeflow PyTorchJob, mpirun).
The world is read from the environment and the worker runs in this process; every rank uses the job dir rank 0's
command chose, learnt through the rendezvous store, and only rank 0 reports the job."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.exceptions import ConfigError, Interrupted, RankFailure
from ddpexp.launchers.base import Handle, JobDir, Started, resolve_local, tail, this_command
from ddpexp.launchers.world import World, outside_world


@dataclass
class EnvConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.env.launch"
    job_dir_timeout_s: float = 300.0  # how long a rank waits for rank 0's command to name the job dir

    def __post_init__(self) -> None:
        check(self.job_dir_timeout_s > 0, f"launcher.job_dir_timeout_s={self.job_dir_timeout_s}: must be > 0")


def resolve(cfg: Any) -> None:
    """gpus = the ranks the outside launcher started on this host (a `gpus=` given must agree); the device as for
    a launcher that starts ranks here."""
    world = outside_world()
    if world is None:
        raise ConfigError("launcher=env: no outside world here (torchrun's, srun's, mpirun's variables, or "
                          "MASTER_ADDR, MASTER_PORT, WORLD_SIZE>1, RANK); start the command under such a launcher, "
                          "or use launcher=spawn")  # fmt: skip
    check(
        cfg.gpus in (None, world.local_world_size),
        f"gpus={cfg.gpus}: {world.source} started {world.local_world_size} rank(s) on this host; leave gpus out "
        f"(or gpus={world.local_world_size})",
    )
    cfg.gpus = world.local_world_size
    resolve_local(cfg)
    print(f"ddpexp: {world.describe()} (launcher=env)", flush=True)


def world_size(config: dict[str, Any]) -> int | None:
    """Known only from the outside launcher's environment, at start."""
    return None


def job_dir(lcfg: Any, proposed: str) -> JobDir:
    """Rank 0's job dir, for every rank: each rank's command had Hydra propose its own (timestamped: it can differ
    by a second between processes and hosts). Rank 0 tells the others through the store at MASTER_ADDR:MASTER_PORT
    before Hydra writes anything: torchrun's agent hosts it, else rank 0 does, here, multi-tenant, and its process
    group re-uses it (env:// opens rank 0's store so): kept for the command's lifetime. A rank 0 that torchrun
    restarted takes the first attempt's dir, whose checkpoints the ranks resume from (first_attempt_dir)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    world = outside_world()
    if world is None:  # resolve() refuses launcher=env here, in one line
        return JobDir(proposed)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    timeout = timedelta(seconds=lcfg.job_dir_timeout_s)
    store = TCPStore(world.master_addr, world.master_port, is_master=world.rank == 0 and not agent,
                     timeout=timeout, wait_for_workers=False, multi_tenant=True)  # fmt: skip
    key = f"ddpexp/job_dir/{world.restarts}"
    if world.rank == 0:
        agreed = first_attempt_dir(world, proposed)
        store.set(key, agreed)
        return JobDir(agreed, leader=True, keep=store)
    try:
        agreed = store.get(key).decode()
    except RuntimeError as e:  # timed out: rank 0 never got this far (its command failed, or is another job's)
        raise ConfigError(f"launcher=env: rank 0 named no job dir within launcher.job_dir_timeout_s="
                          f"{lcfg.job_dir_timeout_s} s ({str(e).splitlines()[0]})") from None  # fmt: skip
    return JobDir(agreed, leader=False, keep=store)


VISIBLE_WAIT_S = 30.0  # a network filesystem may show rank 0's files on another host a bit later


def check_visible(job_dir: str, wait_s: float) -> None:
    """A rank on another host must see rank 0's job dir (checkpoints to resume from, the record): one line if
    rank 0's lock file there (held while its job runs) does not appear here within `wait_s`. Checked once the job
    starts: this rank's own Hydra makes the dir wherever it is, and a plan or a refusal never starts the job (rank
    0's command may have taken its dir away again by then)."""
    import socket
    import time

    from ddpexp.job import LOCK

    deadline = time.monotonic() + wait_s
    while not os.path.isfile(os.path.join(job_dir, LOCK)):
        if time.monotonic() > deadline:
            raise ConfigError(
                f"launcher=env: rank 0's job dir {job_dir} is not visible on {socket.gethostname()} after {wait_s:g} s;"
                " with ranks on several hosts the job dir must be on storage they all see (set hydra.run.dir=)"
            )
        time.sleep(0.1)


def first_attempt_dir(world: World, proposed: str) -> str:
    """For torchrun's restarts of one job (one run id), rank 0's first dir, noted in a file of rank 0's host (a
    restart does not keep the workers' store when TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gloo needs). Where
    rank 0 may move to another host between attempts, hydra.run.dir= on the command line is what holds."""
    if not world.run_id:
        return proposed
    note = os.path.join(tempfile.gettempdir(), f"ddpexp-torchrun-{world.run_id}.job_dir")
    if world.restarts > 0 and os.path.isfile(note):
        with open(note) as f:
            return f.read().strip() or proposed
    with open(note, "w") as f:
        f.write(proposed)
    return proposed


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Handle:
    """The rank runs in this process, in the job dir the ranks agreed on (job_dir)."""
    world = outside_world()
    assert world is not None  # resolve() said so
    if world.rank > 0:
        check_visible(job.dir, VISIBLE_WAIT_S)
    os.environ.update(RANK=str(world.rank), LOCAL_RANK=str(world.local_rank), WORLD_SIZE=str(world.world_size),
                      LOCAL_WORLD_SIZE=str(world.local_world_size), MASTER_ADDR=world.master_addr,
                      MASTER_PORT=str(world.master_port))  # fmt: skip
    job = replace(job, restarts=world.restarts, record={"started_by": world.source})
    return Started(partial(_run, worker, cfg, job, world), reports=world.rank == 0)


def _run(worker: Callable[..., Any], cfg: Any, job: Any, world: World) -> None:
    try:
        status = worker(cfg, job)
    except Exception:
        raise RankFailure(world.rank, tail(traceback.format_exc())) from None
    if status in ("interrupted", "requeued") and world.rank > 0:  # rank 0's command reads it from the record
        raise Interrupted(f"{world.describe()}: stopped on a signal; rank 0's command says where and how to resume")


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    world = outside_world()
    assert world is not None
    env = {"RANK": str(world.rank), "LOCAL_RANK": str(world.local_rank), "WORLD_SIZE": str(world.world_size),
           "LOCAL_WORLD_SIZE": str(world.local_world_size), "MASTER_ADDR": world.master_addr,
           "MASTER_PORT": str(world.master_port)}  # fmt: skip
    return {"command": f"{this_command(job)}  ({world.describe()}) -> ddpexp.rank.worker.main here", "ranks": [env]}
