"""The world an outside launcher (torchrun, srun, mpirun, a Kubeflow PyTorchJob) started this process in, read from
the variables each sets; launcher=env runs as one of its ranks, and the local launchers refuse to start ranks inside
it (they would start ranks inside ranks)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any

from ddpexp.exceptions import ConfigError


@dataclass(frozen=True)
class World:
    """The world an outside launcher started this process in, as PyTorch's env:// names it."""

    source: str  # torchrun, srun, mpirun, or env (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK: a PyTorchJob's)
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restarts: int = 0
    run_id: str = ""  # the same for every attempt of a job that its launcher restarts (torchrun's --rdzv-id)

    def describe(self) -> str:
        by = "MASTER_ADDR, WORLD_SIZE, RANK" if self.source == "env" else self.source
        return f"started by {by}: rank {self.rank} of {self.world_size}"


def slurm_port(env: Any) -> int:
    """The rendezvous port of a Slurm step: every task computes it alike from the job and step ids (Lightning does
    the same), in 15000-29999, below Linux's ephemeral ports (32768-60999), where a port bound as port 0 or an
    outgoing connection takes its own: a port drawn from 20000-60000 (submitit's) was taken that way here."""
    return 15000 + (int(env.get("SLURM_JOB_ID", 0)) * 7 + int(env.get("SLURM_STEP_ID", 0))) % 15000


def outside_world(env: Any = os.environ) -> World | None:
    """The world another launcher started this process in (a world of more than one rank), or None."""
    try:
        if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
            return _world("torchrun", env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"],
                          env, restarts=env.get("TORCHELASTIC_RESTART_COUNT", 0),
                          run_id=env["TORCHELASTIC_RUN_ID"])  # fmt: skip
        if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:  # a task of `srun` (a batch script has none)
            per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), int(env.get("SLURM_NODEID", 0)))
            master = env.get("MASTER_ADDR") or _first_host(env.get("SLURM_STEP_NODELIST", "localhost"))
            port = env.get("MASTER_PORT") or slurm_port(env)
            return _world("srun", env["SLURM_PROCID"], env.get("SLURM_LOCALID", 0), env["SLURM_STEP_NUM_TASKS"],
                          per_node, {"MASTER_ADDR": master, "MASTER_PORT": port},
                          restarts=env.get("SLURM_RESTART_COUNT", 0))  # fmt: skip
        if "OMPI_COMM_WORLD_RANK" in env:
            return _world("mpirun", env["OMPI_COMM_WORLD_RANK"], env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                          env["OMPI_COMM_WORLD_SIZE"], env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1), env)  # fmt: skip
        if "WORLD_SIZE" in env and "RANK" in env:  # a PyTorchJob's pod: one rank per host unless LOCAL_RANK says
            return _world("env", env["RANK"], env.get("LOCAL_RANK", 0), env["WORLD_SIZE"],
                          env.get("LOCAL_WORLD_SIZE", 1), env)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"launcher=env: the outside launcher's variables are not numbers ({e})") from None
    return None


def _world(
    source: str, rank: Any, local: Any, size: Any, local_size: Any, master: Any, restarts: Any = 0, run_id: str = ""
) -> World | None:
    if int(size) <= 1:
        return None
    addr, port = master.get("MASTER_ADDR"), master.get("MASTER_PORT")
    if not addr or not port:
        raise ConfigError(f"launcher=env: {source} started rank {rank} of {size} but MASTER_ADDR and MASTER_PORT are "
                          "not both set; export them (rank 0's host and a free port) to every rank")  # fmt: skip
    return World(
        source, int(rank), int(local), int(size), int(local_size), str(addr), int(port), int(restarts), str(run_id)
    )


def _tasks_per_node(spec: str, node: int) -> int:
    """Slurm's `2(x3),1` (3 nodes of 2 tasks, then 1) for node `node`."""
    nodes = []
    for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", spec):
        nodes += [int(count)] * int(times or 1)
    return nodes[node] if node < len(nodes) else 1


def _first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (`node[3-5,7],gpu1` -> node3); scontrol expands it where it can."""
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    found = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)
    return (found.group(1) + (found.group(2) or "")) if found else nodelist


def refuse_inside(launcher: str) -> None:
    """A launcher that starts its own ranks on this machine, inside a world someone else started: one line."""
    world = outside_world()
    if world is not None:
        raise ConfigError(
            f"launcher={launcher}: this command is {world.describe()} already; launcher={launcher} would start "
            "ranks inside each rank. Use launcher=env (the default there: leave launcher= out)"
        )
