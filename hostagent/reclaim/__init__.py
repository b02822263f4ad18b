"""The memory reclaim service (``python -m hostagent.reclaim``): one per host, beside the host agent,
which it meets only on the bus (``bus.subjects.reclaim_targets`` / ``reclaim_report``).

- ``_service``: the passes (idleness, reclaim steps, reports)
- ``_memcg``: a sandbox's cgroup v1 figures and the reclaim step
- ``_host``: the zram swap and ksmd it sets up
"""

from ._config import ReclaimConfig
from ._host import SwapRefused
from ._service import ReclaimService

__all__ = ["ReclaimConfig", "ReclaimService", "SwapRefused"]
