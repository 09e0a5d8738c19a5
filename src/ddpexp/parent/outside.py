"""A command inside a world that another launcher started (torchrun, srun, a PyTorchJob): it runs as one rank,
launcher=env, when it names no launcher; a sweep there is refused (every rank would run one)."""

from __future__ import annotations

from ddpexp.exceptions import CommandError
from ddpexp.launchers.world import outside_world


def with_outside_launcher(overrides: list[str]) -> list[str]:
    """Inside a world another launcher started, a command that names no launcher runs as launcher=env."""
    if outside_world() is None or any(o.lstrip("+~").startswith("launcher=") for o in overrides):
        return overrides
    return [*overrides, "launcher=env"]


def refuse_sweep() -> None:
    world = outside_world()
    if world is not None:
        raise CommandError(
            f"-m: this command is {world.describe()}; each rank would run a sweep of its own. Run the sweep from "
            "outside (ddpexp -m ... with launcher=spawn, torchrun or slurm), or one job per outside launch"
        )
