"""Guard decides: security profiles (KV ``dsec_profiles``) and the audit watcher (kernel audit
records of seccomp/Landlock denials and of writes refused by read-only system paths, and the
packets the host's egress rules drop).

Host agents enforce the profiles (``hostagent._profiles``); the two never import each other.
Run it with ``python -m guard``.
"""

from ._config import GuardConfig
from ._kernel import AUDIT_LOGINUID, READONLY_KEY, Denial, KernelAudit, ReadonlyRules, SandboxMap, parse_record
from ._nflog import NflogError, NflogReader
from bus.profiles import DEFAULT_VERSION, DENY_IOCTLS, builtin_profiles, default_profile, strict_profile
from ._service import Guard, publish_profiles

__all__ = [
    "AUDIT_LOGINUID",
    "DEFAULT_VERSION",
    "DENY_IOCTLS",
    "Denial",
    "Guard",
    "GuardConfig",
    "KernelAudit",
    "NflogError",
    "NflogReader",
    "READONLY_KEY",
    "ReadonlyRules",
    "SandboxMap",
    "builtin_profiles",
    "default_profile",
    "parse_record",
    "publish_profiles",
    "strict_profile",
]
