"""The built-in security profiles guard publishes: ``default`` and ``strict``.

A profile is data (``bus.messages.SecurityProfile``); the host agent turns it into the OCI spec's
seccomp filter, capabilities and masked/read-only paths plus the in-sandbox agent's Landlock rules
and audited seccomp filter (``hostagent._profiles``). Bump ``DEFAULT_VERSION`` whenever the content
changes: guard replaces a stored profile only by a newer version, so an operator's edit that
raised the version is kept.

System paths are guarded twice. Landlock (``fs.read_only``) refuses writing, creating, renaming and
removing there, but Landlock has no rights for metadata: root would still chmod, chown, touch,
set or remove xattrs and change inode flags of /bin/sh. So they are also read-only mounts
(``fs.readonly_paths``), which refuse all of that with EROFS. A write there fails on the mount flag
before Landlock sees it, so it is not in Landlock's audit records; guard reports it from audit
rules of its own instead (kind ``fs``, acted on as ``audit.landlock`` says).

They live in ``bus`` because both sides need them: guard publishes them, and the host agent uses
them as its fallback while the KV bucket has none yet (so a create never waits on guard).
"""

from __future__ import annotations

import msgspec

from .messages import AuditPolicy, FsPolicy, SecurityProfile, SyscallArg, SyscallPolicy, SyscallRule

DEFAULT_VERSION = 3  # 3: e2b without no_new_privileges

# Docker's default allow-list (moby profiles/seccomp/default.json) without the calls we refuse
# outright below (io_uring, name_to_handle_at, ...), plus a few newer harmless calls.
ALLOW: tuple[str, ...] = (
    "accept", "accept4", "access", "adjtimex", "alarm", "arch_prctl", "bind", "brk", "cachestat",
    "capget", "capset", "chdir", "chmod", "chown", "chown32", "chroot", "clock_adjtime",
    "clock_adjtime64", "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64",
    "clock_nanosleep", "clock_nanosleep_time64", "close", "close_range", "connect",
    "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_ctl_old", "epoll_pwait", "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd",
    "eventfd2", "execve", "execveat", "exit", "exit_group", "faccessat", "faccessat2", "fadvise64",
    "fadvise64_64", "fallocate", "fanotify_mark", "fchdir", "fchmod", "fchmodat", "fchmodat2",
    "fchown", "fchown32", "fchownat", "fcntl", "fcntl64", "fdatasync", "fgetxattr", "flistxattr",
    "flock", "fork", "fremovexattr", "fsetxattr", "fstat", "fstat64", "fstatat64", "fstatfs",
    "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futex", "futex_requeue", "futex_time64",
    "futex_wait", "futex_waitv", "futex_wake", "futimesat", "getcpu", "getcwd", "getdents",
    "getdents64", "getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32", "getgroups",
    "getgroups32", "getitimer", "getpeername", "getpgid", "getpgrp", "getpid", "getppid",
    "getpriority", "getrandom", "getresgid", "getresgid32", "getresuid", "getresuid32", "getrlimit",
    "get_robust_list", "getrusage", "getsid", "getsockname", "getsockopt", "get_thread_area",
    "gettid", "gettimeofday", "getuid", "getuid32", "getxattr", "getxattrat", "inotify_add_watch",
    "inotify_init", "inotify_init1", "inotify_rm_watch", "io_cancel", "ioctl", "io_destroy",
    "io_getevents", "io_pgetevents", "io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup",
    "io_submit", "ipc", "kill", "landlock_add_rule", "landlock_create_ruleset",
    "landlock_restrict_self", "lchown", "lchown32", "lgetxattr", "link", "linkat", "listen",
    "listxattr", "listxattrat", "llistxattr", "_llseek", "lremovexattr", "lseek", "lsetxattr",
    "lstat", "lstat64", "madvise", "map_shadow_stack", "membarrier", "memfd_create", "memfd_secret",
    "mincore", "mkdir", "mkdirat", "mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect",
    "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedreceive_time64",
    "mq_timedsend", "mq_timedsend_time64", "mq_unlink", "mremap", "mseal", "msgctl", "msgget",
    "msgrcv", "msgsnd", "msync", "munlock", "munlockall", "munmap", "nanosleep", "newfstatat",
    "_newselect", "open", "openat", "openat2", "pause", "pidfd_open", "pidfd_send_signal", "pipe",
    "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll", "ppoll", "ppoll_time64", "prctl",
    "pread64", "preadv", "preadv2", "prlimit64", "process_mrelease", "pselect6", "pselect6_time64",
    "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv",
    "recv", "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "remap_file_pages",
    "removexattr", "removexattrat", "rename", "renameat", "renameat2", "restart_syscall", "rmdir",
    "rseq", "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn",
    "rt_sigsuspend", "rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_tgsigqueueinfo",
    "sched_getaffinity", "sched_getattr", "sched_getparam", "sched_get_priority_max",
    "sched_get_priority_min", "sched_getscheduler", "sched_rr_get_interval",
    "sched_rr_get_interval_time64", "sched_setaffinity", "sched_setattr", "sched_setparam",
    "sched_setscheduler", "sched_yield", "seccomp", "select", "semctl", "semget", "semop",
    "semtimedop", "semtimedop_time64", "send", "sendfile", "sendfile64", "sendmmsg", "sendmsg",
    "sendto", "setfsgid", "setfsgid32", "setfsuid", "setfsuid32", "setgid", "setgid32",
    "setgroups", "setgroups32", "setitimer", "setpgid", "setpriority", "setregid", "setregid32",
    "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid", "setreuid32", "setrlimit",
    "set_robust_list", "setsid", "setsockopt", "set_thread_area", "set_tid_address", "setuid",
    "setuid32", "setxattr", "setxattrat", "shmat", "shmctl", "shmdt", "shmget", "shutdown",
    "sigaltstack", "signalfd", "signalfd4", "sigprocmask", "sigreturn", "socketcall", "socketpair",
    "splice", "stat", "stat64", "statfs", "statfs64", "statx", "symlink", "symlinkat", "sync",
    "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time", "timer_create",
    "timer_delete", "timer_getoverrun", "timer_gettime", "timer_gettime64", "timer_settime",
    "timer_settime64", "timerfd_create", "timerfd_gettime", "timerfd_gettime64", "timerfd_settime",
    "timerfd_settime64", "times", "tkill", "truncate", "truncate64", "ugetrlimit", "umask", "uname",
    "unlink", "unlinkat", "uretprobe", "utime", "utimensat", "utimensat_time64", "utimes", "vfork",
    "vmsplice", "wait4", "waitid", "waitpid", "write", "writev",
)

# Refused explicitly and reported. Most need a capability the sandbox doesn't have; the rest
# (bpf, perf, io_uring, userfaultfd, keyrings, user namespaces) are reachable without one and
# are where kernel exploits live. ptrace and process_vm_* would let one process of the sandbox
# rewrite another -- say, the grader's test run.
DENY: tuple[str, ...] = (
    # mount API and root switching
    "mount", "umount", "umount2", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "pivot_root",
    # namespaces (unshare and clone: only the namespace flags, below)
    "setns",
    # kernel attack surface reachable without capabilities
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key",
    # kernel images and modules
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module", "query_module", "get_kernel_syms",
    # file handles bypass path-based access control
    "open_by_handle_at", "name_to_handle_at",
    # other processes' memory and descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise", "kcmp",
    # host-wide state
    "acct", "swapon", "swapoff", "reboot", "syslog", "quotactl", "quotactl_fd", "lookup_dcookie",
    "nfsservctl", "uselib", "vhangup", "iopl", "ioperm", "modify_ldt", "settimeofday", "stime",
    "clock_settime", "clock_settime64", "sethostname", "setdomainname", "fanotify_init",
    "lsm_set_self_attr",
)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080  # unshare/clone3 only: in clone(2) that byte is the exit signal
CLONE_NS_FLAGS = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET)
CLONE_NS_MASK = sum(CLONE_NS_FLAGS)
UNSHARE_NS_MASK = CLONE_NS_MASK | CLONE_NEWTIME

S_IFMT, S_IFSOCK, S_IFREG, S_IFBLK, S_IFCHR, S_IFIFO = 0o170000, 0o140000, 0o100000, 0o060000, 0o020000, 0o010000


def _ioc(direction: int, type_: int, nr: int, size: int) -> int:
    return direction << 30 | size << 16 | type_ << 8 | nr


_IOW, _IOR, _IOWR = 1, 2, 3

# ioctls that swap, move or share file extents: they act on a file's blocks beneath the VFS
# permission and LSM checks of ordinary writes. (BTRFS_IOC_CLONE, _CLONE_RANGE and
# _FILE_EXTENT_SAME share numbers with the FI* ones.)
DENY_IOCTLS: dict[str, int] = {
    "FICLONE": _ioc(_IOW, 0x94, 9, 4),
    "FICLONERANGE": _ioc(_IOW, 0x94, 13, 32),
    "FIDEDUPERANGE": _ioc(_IOWR, 0x94, 54, 24),
    "XFS_IOC_SWAPEXT": _ioc(_IOWR, ord("X"), 109, 192),
    "XFS_IOC_EXCHANGE_RANGE": _ioc(_IOW, ord("X"), 129, 40),
    "EXT4_IOC_MOVE_EXT": _ioc(_IOWR, ord("f"), 15, 40),
    "EXT4_IOC_SWAP_BOOT": _ioc(0, ord("f"), 17, 0),
    # terminal input injection (a classic escape when a tty is shared)
    "TIOCSTI": 0x5412,
    "TIOCLINUX": 0x541C,
}

MASKED_PATHS: tuple[str, ...] = (
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS: tuple[str, ...] = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
# Read-only mounts over the image's system directories (runc skips those an image lacks; a merged-/usr
# image's /bin -> usr/bin symlink is followed). None may hold a writable path: a mount covers all
# beneath it.
SYSTEM_PATHS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")

# Docker's default capabilities without NET_RAW and MKNOD. Never granted: SYS_ADMIN, NET_ADMIN,
# SYS_MODULE, SYS_RAWIO, SYS_PTRACE, SYS_TIME, SYS_BOOT, BPF, PERFMON, DAC_READ_SEARCH, ...
CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)

WRITABLE: tuple[str, ...] = ("/tmp", "/var/tmp", "/workspace", "/root", "/home", "/run", "/dev/shm")
DEVICES: tuple[str, ...] = ("/dev",)


def _masked(index: int, mask: int, value: int) -> SyscallArg:
    return SyscallArg(index=index, op="masked_eq", mask=mask, value=value)


def _syscalls() -> SyscallPolicy:
    allow_if = [
        SyscallRule(names=["clone"], args=[_masked(0, CLONE_NS_MASK, 0)], comment="no new namespaces"),
        SyscallRule(names=["unshare"], args=[_masked(0, UNSHARE_NS_MASK, 0)], comment="no new namespaces"),
        SyscallRule(names=["socket"], args=[SyscallArg(index=0, op="ne", value=40)], comment="no AF_VSOCK"),
    ]
    for kind in (0, S_IFREG, S_IFIFO, S_IFSOCK):
        allow_if.append(SyscallRule(names=["mknod"], args=[_masked(1, S_IFMT, kind)], comment="no device nodes"))
        allow_if.append(SyscallRule(names=["mknodat"], args=[_masked(2, S_IFMT, kind)], comment="no device nodes"))
    for persona in (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF):
        allow_if.append(SyscallRule(names=["personality"], args=[SyscallArg(index=0, op="eq", value=persona)]))
    deny = [SyscallRule(names=list(DENY))]
    for flag in CLONE_NS_FLAGS:
        deny.append(SyscallRule(names=["clone"], args=[_masked(0, flag, flag)], comment=f"namespace flag {flag:#x}"))
    for flag in (*CLONE_NS_FLAGS, CLONE_NEWTIME):
        deny.append(SyscallRule(names=["unshare"], args=[_masked(0, flag, flag)], comment=f"namespace flag {flag:#x}"))
    for kind in (S_IFCHR, S_IFBLK):
        deny.append(SyscallRule(names=["mknod"], args=[_masked(1, S_IFMT, kind)], comment="device node"))
        deny.append(SyscallRule(names=["mknodat"], args=[_masked(2, S_IFMT, kind)], comment="device node"))
    for name, number in DENY_IOCTLS.items():
        # 32-bit masked compare: the kernel takes the request as an unsigned int.
        deny.append(SyscallRule(names=["ioctl"], args=[_masked(1, 0xFFFFFFFF, number)], comment=name))
    return SyscallPolicy(
        default_errno=1, allow=list(ALLOW), allow_if=allow_if, deny=deny, enosys=["clone3"], native_only=True,
    )


def default_profile() -> SecurityProfile:
    return SecurityProfile(
        name="default",
        version=DEFAULT_VERSION,
        description="Root in the sandbox, but system paths read-only (Landlock, and read-only mounts for /usr, /bin, "
        "/sbin, /lib*, /etc), Docker-like seccomp allow-list "
        "with mount/namespace/bpf/io_uring/extent-swap calls refused and reported, no dangerous capabilities.",
        fs=FsPolicy(
            landlock=True, required=True, read_only=["/"], writable=list(WRITABLE), devices=list(DEVICES),
            masked_paths=list(MASKED_PATHS), readonly_paths=[*READONLY_PATHS, *SYSTEM_PATHS],
        ),
        syscalls=_syscalls(),
        capabilities=list(CAPABILITIES),
        no_new_privileges=True,
        audit=AuditPolicy(seccomp="record", landlock="record", other="record"),
    )


def strict_profile() -> SecurityProfile:
    """``default``, and a sandbox that trips a seccomp or Landlock rule is killed."""
    p = default_profile()
    return msgspec.structs.replace(
        p, name="strict", description="default, and the first refused syscall or filesystem access kills the sandbox.",
        audit=AuditPolicy(seccomp="kill", landlock="kill", other="record"),
    )


def build_profile() -> SecurityProfile:
    """``default`` with the image's files writable everywhere: an image build's RUN installs into /usr and
    /etc as ``docker build`` does (in the sandbox's own upper dir; seccomp and capabilities as default)."""
    p = default_profile()
    return msgspec.structs.replace(
        p, name="build", description="default, but every path of the image writable (image builds: RUN installs into /usr, /etc).",
        fs=msgspec.structs.replace(p.fs, landlock=False, required=False, readonly_paths=list(READONLY_PATHS)),
    )


def e2b_profile() -> SecurityProfile:
    """What an E2B sandbox is to its root user: every path of its image writable (in the sandbox's own
    upper dir), seccomp and capabilities as ``default``. Harbor and other E2B clients write /etc, /app,
    /logs, /tests; a gateway started with ``DSEC_GATEWAY_E2B_PROFILE=e2b`` gives its creates this one.

    And setuid programs work: E2B runs commands as ``user``, and agents run ``sudo apt-get ...``.
    Only here: no_new_privileges stays on in every other profile, where the user a command runs as
    is the most it can ever be (a setuid binary a tenant planted in its image, or a bug in one the
    image ships, is a way to root inside the sandbox). In an E2B sandbox that user may become root
    by design, and root is still bounded by the same seccomp filter, capability bounding set,
    cgroups and read-only layers; the host lends the agent CAP_SYS_ADMIN only to install its own
    filter without no_new_privs, outside the bounding set (``hostagent._profiles``)."""
    p = build_profile()
    return msgspec.structs.replace(p, name="e2b", no_new_privileges=False,
                                   description="default, but every path of the image writable and setuid programs (sudo) "
                                   "working (root in an E2B sandbox, user `user` may sudo).")


def builtin_profiles() -> dict[str, SecurityProfile]:
    return {p.name: p for p in (default_profile(), strict_profile(), build_profile(), e2b_profile())}


__all__ = ["DEFAULT_VERSION", "DENY_IOCTLS", "SYSTEM_PATHS", "build_profile", "builtin_profiles", "default_profile", "e2b_profile", "strict_profile"]
