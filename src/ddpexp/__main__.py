"""`python -m ddpexp [overrides]`: Hydra composes conf/, then parent.run() launches the job (or each job of -m).
`python -m ddpexp report PATH...` tabulates finished jobs (ddpexp.report)."""

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
    from ddpexp.parent import run

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_in_sweep(dcfg)
    return report(lambda: run(dcfg))


def run_in_sweep(dcfg: Any) -> Any:
    """One job of a multirun: a failure is recorded and counted, and the sweep goes on (Hydra's basic sweeper
    would stop it); an Optuna sweeper records a failed trial. A signal stops the whole sweep."""
    from hydra.core.hydra_config import HydraConfig

    from ddpexp.errors import FAILED, is_config_error, one_line
    from ddpexp.launchers import Interrupted, RankFailure
    from ddpexp.objective import failed_trial
    from ddpexp.parent import run

    try:
        return run(dcfg)
    except Interrupted:
        raise
    except Exception as e:
        if not isinstance(e, RankFailure) and not is_config_error(e):
            raise
        line = str(e).splitlines()[0] if isinstance(e, RankFailure) else one_line(e)
        FAILED.append(f"{HydraConfig.get().runtime.output_dir}: {line}")
        print(f"ddpexp: error: job {HydraConfig.get().job.num} failed: {line}", file=sys.stderr)
        return failed_trial()


def main() -> None:
    if sys.argv[1:2] == ["report"]:  # `ddpexp report PATH...`: reads run records, composes no config
        from ddpexp.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    from ddpexp.config import register_configs
    from ddpexp.errors import FAILED, failed_jobs_message, install_error_reporting
    from ddpexp.sweep import install_record_guard

    if not os.path.isdir(CONF_DIR):
        sys.exit(
            f"ddpexp: error: no conf/ at {os.path.normpath(CONF_DIR)}: install ddpexp from its checkout (pip install -e .)"
        )
    register_configs()
    install_error_reporting()
    install_record_guard()
    hydra.main(config_path=os.path.normpath(CONF_DIR), config_name="config", version_base="1.3")(_task)()
    if "ddpexp.parent" in sys.modules:  # a multirun that submitted jobs to a scheduler: wait for them now
        FAILED.extend(sys.modules["ddpexp.parent"].wait_deferred())
    if FAILED:
        sys.exit(failed_jobs_message())


if __name__ == "__main__":
    main()
