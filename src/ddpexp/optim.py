"""The public path of ddpexp.parts.optim (`_target_: ddpexp.optim.NAME` in conf/ and in users' YAMLs)."""

from ddpexp.parts.optim import *  # noqa: F403
