"""The public path of ddpexp.parts.tasks (`_target_: ddpexp.tasks.NAME` in conf/ and in users' YAMLs)."""

from ddpexp.parts.tasks import *  # noqa: F403
