"""`ddpexp [overrides]` (or `python -m ddpexp`): Hydra composes ddpexp's configs (packaged as ddpexp/conf/) and a
user project's (`--config-dir DIR`, or ./conf), then the parent runs the job (or each job of -m).
`ddpexp report PATH...` tabulates finished jobs (ddpexp.report); `ddpexp eval RUN_DIR` scores a run's checkpoint
again (ddpexp.cli.evaluate). From Python: ddpexp.run([...]) (ddpexp.cli.api), ddpexp.evaluate, ddpexp.load_model."""

from __future__ import annotations

import io
import sys

import hydra


def whole_lines() -> None:
    """Each printed line in one write. Unbuffered (python -u, PYTHONUNBUFFERED=1), print writes its text and its
    newline apart, and the lines of commands that share one stdout (torchrun's ranks) ran into each other."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.write_through:
            stream.reconfigure(write_through=False, line_buffering=True)


def main() -> None:
    whole_lines()
    if sys.argv[1:2] == ["report"]:  # `ddpexp report PATH...`: reads run records, composes no config
        from ddpexp.report.main import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if sys.argv[1:2] == ["eval"]:  # `ddpexp eval RUN_DIR ...`: the run's own config, composes none
        from ddpexp.cli.evaluate import main as eval_main

        sys.exit(eval_main(sys.argv[2:]))
    if sys.argv[1:2] == ["--version"]:  # hydra.main's own --version names Hydra's version
        from importlib.metadata import version

        print(f"ddpexp {version('ddpexp')}")
        sys.exit(0)
    from ddpexp.cli import hydra_patches, project
    from ddpexp.cli.command import task_function
    from ddpexp.cli.errors import report
    from ddpexp.parent.command import Command
    from ddpexp.parent.compat import with_declared_keys
    from ddpexp.parent.outside import with_outside_launcher
    from ddpexp.parent.schema import register_configs
    from ddpexp.parent.wait import wait_deferred

    given = project.given_config_dir(sys.argv[1:])
    conf = project.config_dir(given)
    if conf is not None and given is None:  # ./conf: as if given, so the resume and plan lines carry it
        sys.argv[1:1] = ["--config-dir", conf]
    sys.argv[1:] = with_outside_launcher(sys.argv[1:])  # started by torchrun, srun...: launcher=env
    sys.argv[1:] = with_declared_keys(sys.argv[1:])  # +data.test_fraction=F from before it was declared
    register_configs()
    cmd = Command(argv=sys.argv[1:])  # the command's state, for its whole lifetime
    with hydra_patches.installed(cmd, cli=True), project.on_path(conf):
        hydra.main(config_path=project.PACKAGE_CONF, config_name="config", version_base="1.3")(task_function(cmd))()
        # A multirun that submitted jobs to a scheduler, or runs them at once (sweep.parallel): wait for them now.
        report(lambda: wait_deferred(cmd), cmd)
        if cmd.failed:
            sys.exit(f"ddpexp: {cmd.failed_jobs_message()}")
