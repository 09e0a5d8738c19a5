"""A user's project: a folder holding its own conf/ (model/, data/, experiment/, ... YAMLs) and its Python package.

ddpexp's own configs ship inside the package (`pkg://ddpexp.conf`, the primary config). A project's config dir
comes from `--config-dir DIR`, or is the conf/ of the current directory; Hydra searches it after ddpexp's, so its
groups extend ddpexp's (`model=mynet` beside `model=resnet18`). The folder holding it goes first on sys.path, so
the project's `_target_`s import with the `ddpexp` script and `ddpexp.run` as they do with `python -m ddpexp`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PACKAGE_CONF = "pkg://ddpexp.conf"  # conf/ of the checkout, packaged as ddpexp/conf/ (pyproject.toml)
PROJECT_CONF = "conf"  # a project's config dir, found in the current directory


def given_config_dir(argv: list[str]) -> str | None:
    """The value of Hydra's `--config-dir`/`-cd` on a command line (Hydra's own parser reports a bad one)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--config-dir", "-cd")
    try:
        return parser.parse_known_args(argv)[0].config_dir
    except argparse.ArgumentError:
        return None


def config_dir(given: str | None) -> str | None:
    """The project's config dir, absolute: `given`, else ./conf if there is one and it is not ddpexp's own (a
    checkout's conf/, which is the package's configs already)."""
    if given is not None:
        return os.path.abspath(given)
    here = os.path.abspath(PROJECT_CONF)
    if not os.path.isdir(here) or _is_ddpexp_conf(here):
        return None
    return here


def _is_ddpexp_conf(path: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE_CONF.removeprefix("pkg://"))
    locations = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.isdir(p) and os.path.samefile(p, path) for p in locations)


@contextmanager
def on_path(conf_dir: str | None) -> Iterator[None]:
    """While a command runs: the project's folder (its config dir's parent) first on sys.path, which spawned and
    torchrun ranks inherit, and on PYTHONPATH, which reaches ranks a scheduler starts (Slurm). Both put back after."""
    if conf_dir is None or not os.path.isdir(conf_dir):
        yield
        return
    root = os.path.dirname(conf_dir)
    added, saved_env = root not in sys.path, os.environ.get("PYTHONPATH")
    if added:
        sys.path.insert(0, root)
    if root not in (saved_env or "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *([saved_env] if saved_env else [])])
    try:
        yield
    finally:
        if added and root in sys.path:
            sys.path.remove(root)
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env
