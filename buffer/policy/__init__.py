"""Asynchronous RL under control: policy versions, pause and resume, staleness, admission, mixing.

``Policy`` (one per buffer) holds the version the engines serve and the ``Gate`` every engine
request of an in-process generator passes; ``Admission`` lets a generator make only what the
trainer will read within ``max_staleness`` versions, and ``stale.StaleGroups`` cancels, in the
generator, what it can no longer serve; ``mixing.allocate`` shares a read between tasks.

Plain Python, no HTTP: a generator in another process follows a buffer's policy through its
own mirror of it, ``buffer.toolkit.remote_policy``, which speaks to the service's routes.
"""

from buffer.policy.admission import Admission
from buffer.policy.gate import Gate
from buffer.policy.state import Policy, PolicyError, find_policy, register_policy
from buffer.policy.versions import group_versions, trajectory_versions

__all__ = [
    "Admission",
    "Gate",
    "Policy",
    "PolicyError",
    "find_policy",
    "group_versions",
    "register_policy",
    "trajectory_versions",
]
