"""The public path of ddpexp.parts.models (`_target_: ddpexp.models.NAME` in conf/ and in users' YAMLs)."""

from ddpexp.parts.models import *  # noqa: F403
