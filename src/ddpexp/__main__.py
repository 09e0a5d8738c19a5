"""`python -m ddpexp [overrides]`: Hydra composes conf/, then run.run() launches the job (or each job of -m)."""

from __future__ import annotations

import os
import sys
from typing import Any

import hydra

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf")


def _task(dcfg: Any) -> Any:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ddpexp.errors import report
    from ddpexp.run import run

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run(dcfg)  # a failed job is recorded by Hydra and the sweep goes on
    return report(lambda: run(dcfg))


def main() -> None:
    from ddpexp.config import register_configs
    from ddpexp.errors import install_error_reporting

    if not os.path.isdir(CONF_DIR):
        sys.exit(
            f"ddpexp: error: no conf/ at {os.path.normpath(CONF_DIR)}: install ddpexp from its checkout (pip install -e .)"
        )
    register_configs()
    install_error_reporting()
    hydra.main(config_path=os.path.normpath(CONF_DIR), config_name="config", version_base="1.3")(_task)()
    if "ddpexp.run" in sys.modules:  # a multirun that submitted jobs to a scheduler: wait for them now
        failed = sys.modules["ddpexp.run"].wait_deferred()
        if failed:
            sys.exit(f"ddpexp: {failed} job(s) failed")


if __name__ == "__main__":
    main()
