"""`ddpexp [overrides]` (or `python -m ddpexp`): Hydra composes ddpexp's configs (packaged as ddpexp/conf/) and a
user project's (`--config-dir DIR`, or ./conf), then parent.run() launches the job (or each job of -m).
`ddpexp report PATH...` tabulates finished jobs (ddpexp.report). From Python: ddpexp.run([...]) (ddpexp.api)."""

from __future__ import annotations

import sys
from typing import Any

import hydra


def _task(dcfg: Any) -> Any:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ddpexp.command import run_in_sweep
    from ddpexp.errors import report
    from ddpexp.parent import run

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_in_sweep(dcfg)
    return report(lambda: run(dcfg))


def main() -> None:
    if sys.argv[1:2] == ["report"]:  # `ddpexp report PATH...`: reads run records, composes no config
        from ddpexp.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    from ddpexp import command, project
    from ddpexp.config import register_configs
    from ddpexp.errors import failed_jobs_message, install_error_reporting
    from ddpexp.sweep import install_record_guard

    given = project.given_config_dir(sys.argv[1:])
    conf = project.config_dir(given)
    if conf is not None and given is None:  # ./conf: as if given, so the resume and plan lines carry it
        sys.argv[1:1] = ["--config-dir", conf]
    register_configs()
    install_error_reporting()
    install_record_guard()
    with command.begin(sys.argv[1:]) as cmd, project.on_path(conf):
        hydra.main(config_path=project.PACKAGE_CONF, config_name="config", version_base="1.3")(_task)()
        command.wait_deferred()  # a multirun that submitted jobs to a scheduler: wait for them now
        if cmd.failed:
            sys.exit(f"ddpexp: {failed_jobs_message()}")


if __name__ == "__main__":
    main()
