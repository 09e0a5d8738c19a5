"""The public path of ddpexp.parts.data (`_target_: ddpexp.data.NAME` in conf/ and in users' YAMLs)."""

from ddpexp.parts.data import *  # noqa: F403
