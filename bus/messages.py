"""Every payload on the bus: versioned msgspec Structs, msgpack on the wire.

Schema evolution: new fields get defaults, field types never change, tags never change.
Each subject has one typed decoder for the union it accepts (see ``bus.codec``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from msgspec import Meta, Struct, field

# --- the wire's vocabulary: every enumeration is a Literal, so msgspec checks it on decode and the
# JSON Schema / AsyncAPI output (bus.schema, ``dsec schema``) lists its values. A new value is a
# schema change: a reader that does not know it refuses the message, so add values before emitters use them.
Priority = Literal["best-effort", "latency-sensitive"]
BackendName = Literal["container", "fncall", "microvm", "vm", "sim"]
Backend = BackendName  # the older name of the same vocabulary
SandboxLiveState = Literal["placed", "creating", "running", "paused", "stopping"]  # placed: records of older hosts
SandboxEndedState = Literal["gone", "lost", "failed", "killed"]  # no sandbox behind the record any more; killed: older hosts
SandboxState = Literal[SandboxLiveState, SandboxEndedState]
# "requested" and "placed" are kept for replays of older streams; placement no longer writes them
# (a ready event's detail carries placed_by and placed_ms).
SandboxEventKind = Literal[
    "requested", "pending", "placed", "rejected", "ready", "failed", "exec", "killed", "timeout", "recovered", "lost", "paused", "resumed",
]
HostState = Literal["ready", "draining", "down"]
HostEventKind = Literal["up", "down", "recovered"]
SnapshotEventKind = Literal["created", "restored", "forked", "removed"]
ImageEventKind = Literal["built", "removed", "fetch_failed", "chunk_corrupt"]
ViolationAction = Literal["record", "kill", "quarantine"]
HandoffState = Literal["done", "working", "refused"]

BACKENDS: tuple[BackendName, ...] = get_args(BackendName)
PRIORITIES: tuple[Priority, ...] = get_args(Priority)
SANDBOX_STATES: tuple[SandboxState, ...] = get_args(SandboxState)
SANDBOX_ENDED: tuple[SandboxEndedState, ...] = get_args(SandboxEndedState)


def _enum(values: tuple[str, ...]) -> Meta:
    return Meta(extra_json_schema={"enum": list(values)})


# A client's spec keeps these two as plain strings on the wire (checked by bus.rules.validate_spec
# against the Literals): a spec with an unknown backend must still decode, so placement can answer its
# creator with a typed ``failed`` event instead of dead-lettering the request. The schema lists the values.
BackendField = Annotated[str, _enum(BACKENDS)]
PriorityField = Annotated[str, _enum(PRIORITIES)]


# --- sandbox spec ----------------------------------------------------------------
class NetworkSpec(Struct, kw_only=True, tag=True):
    """Egress allowlist (CIDR, host:port or domain); empty means no egress."""

    allow_out: list[str] = []


class SandboxSpec(Struct, kw_only=True, tag=True):
    sandbox_id: str
    template: str = "base"
    backend: BackendField = "container"
    cpu: float = 1.0
    memory_mb: int = 512
    disk_mb: int = 1024
    timeout_s: float = 300.0
    envs: dict[str, str] = {}
    metadata: dict[str, str] = {}
    priority: PriorityField = "best-effort"
    pool: str = "default"
    profile: str = "default"
    network: NetworkSpec | None = None
    owner: str = ""
    lease_s: float = 0.0  # 0: no client lease; else reaped when not renewed within this
    requested_at: float = 0.0  # unix seconds, set by the client
    batch_id: str = ""
    create_deadline: float = 0.0  # unix seconds; placement fails the request after this (0: none)
    reply_to: str = ""  # core subject where the client hears this create's outcome (ready/failed/pending); the events are in DSEC_EVT regardless
    snapshot: str = ""  # restore: this snapshot's layers (KV dsec_snapshots) go over the template's, under a fresh upper dir
    generation: int = 0  # a persisted pause's resume starts the same id again one generation up (see bus.subjects.incarnation)
    client: str = ""  # the API client (gateway key's NATS identity) that created it; the gateway shows each key only its own
    # A service tenant that operates the sandbox for its owner (the rollout workers run a tenant's job in
    # a sandbox of that tenant's): its ops are served too. Set by placement's binding only (bus.auth).
    delegate: str = ""
    # When its host is declared down (placement: heartbeats stopped past the grace period), start it again
    # elsewhere from its latest snapshot (same id, one generation up); else it just becomes ``lost``.
    restore_on_host_loss: bool = False


# --- requests on DSEC_REQ ----------------------------------------------------------
class CreateSandbox(Struct, kw_only=True, tag=True):
    spec: SandboxSpec
    attempt: int = 0
    exclude_hosts: list[str] = []
    last_error: str = ""


class CreateBatch(Struct, kw_only=True, tag=True):
    batch_id: str
    specs: list[SandboxSpec]
    attempt: int = 0
    # True when the SDK put concurrent single creates together (sdk/_coalesce.py): placement runs them
    # on hosts as it runs singles that arrive together (at least ``coalesce`` per host), not spread as
    # a batch is.
    singles: bool = False


ReqMessage = CreateSandbox | CreateBatch


# --- work for one host on DSEC_HOST --------------------------------------------------
class PlaceSandbox(Struct, kw_only=True, tag=True):
    spec: SandboxSpec
    host_id: str
    attempt: int = 0
    exclude_hosts: list[str] = []
    placed_by: str = ""
    placed_at: float = 0.0
    claim: bool = False  # hand-off of a redelivered request: hosts claim each id before creating


class PlaceBatch(Struct, kw_only=True, tag=True):
    batch_id: str
    host_id: str
    specs: list[SandboxSpec]
    attempt: int = 0
    placed_by: str = ""
    placed_at: float = 0.0
    claim: bool = False  # hand-off of a redelivered request: hosts claim each id before creating


HostMessage = PlaceSandbox | PlaceBatch


class HandoffReply(Struct, kw_only=True, tag=True):
    """A host's answer on a hand-off's reply subject (bus.runtime.handoff): ``done`` once whatever the
    work led to is durable (records, events, work handed on), ``working`` while it goes on, ``refused``
    (``code``, ``description``) when it was not done: placement then lets the request be placed again."""

    state: HandoffState = "done"
    code: str = ""
    description: str = ""


# --- events on DSEC_EVT ----------------------------------------------------------------
class SandboxEvent(Struct, kw_only=True, tag=True):
    sandbox_id: str
    kind: SandboxEventKind
    at: float
    host_id: str = ""
    attempt: int = 0
    code: str = ""
    description: str = ""
    detail: dict[str, str] = {}


class ReadyMany(Struct, kw_only=True, tag=True):
    """Sandboxes of one hand-off to a host (a host batch) that are ready: told each creating client's
    inbox at once (``reply_to``: its own members), and stored in DSEC_EVT once per tenant of the batch
    on ``dsec.evt.ready.<tenant>.<host>`` (bus.subjects.evt_ready) in place of one ``ready``
    SandboxEvent per member. Each member's record (stored before) is the durable fact; a per-sandbox
    replay finds the batch events that name it. ``detail``: placed_by, create_ms, placed_ms (of the
    batch's earliest request)."""

    sandbox_ids: list[str]
    host_id: str
    at: float
    attempt: int = 0
    batch_id: str = ""
    detail: dict[str, str] = {}


CreateReply = SandboxEvent | ReadyMany  # what a create's reply_to inbox receives


class HostEvent(Struct, kw_only=True, tag=True):
    host_id: str
    kind: HostEventKind
    at: float
    detail: dict[str, str] = {}


class GuardViolation(Struct, kw_only=True, tag=True):
    sandbox_id: str
    at: float
    kind: str  # seccomp, landlock, fs (refused by a read-only mount), network, control-plane, disk (filled the host's disk), ...
    what: str
    action: ViolationAction = "record"
    host_id: str = ""
    detail: dict[str, str] = {}


class ImageEvent(Struct, kw_only=True, tag=True):
    name: str
    kind: ImageEventKind
    at: float
    detail: dict[str, str] = {}


class SnapshotEvent(Struct, kw_only=True, tag=True):
    """Provenance of a snapshot on ``dsec.evt.snapshot.<id>.<kind>``."""

    snapshot_id: str
    kind: SnapshotEventKind
    at: float
    sandbox_id: str = ""  # created: the source; restored: the new sandbox
    parent_id: str = ""
    host_id: str = ""
    metadata: dict[str, str] = {}  # the client's (a training step, say)
    detail: dict[str, str] = {}


EventMessage = SandboxEvent | HostEvent | GuardViolation | ImageEvent | SnapshotEvent | ReadyMany


# --- KV records ---------------------------------------------------------------------------
class HostBackend(Struct, kw_only=True, tag=True):
    """One backend a host runs, as its heartbeat advertises it; placement routes on these."""

    name: BackendName
    max_cpu: float = 0.0  # largest cpu one sandbox may ask on this backend (0: the host's cpu_total)
    max_memory_mb: int = 0  # likewise for memory_mb (0: the host's mem_total_mb)
    max_disk_mb: int = 0  # likewise for disk_mb (0: the host's disk_total_mb)
    detail: dict[str, str] = {}  # what its probe found (for example accel: kvm | tcg); shown by dsec status


class HostStatus(Struct, kw_only=True, tag=True):
    """A host's heartbeat, kept in KV ``dsec_hosts`` under its id."""

    host_id: str
    backend: BackendName
    at: float
    state: HostState = "ready"
    pool: str = "default"
    cpu_total: float = 0.0  # real cores
    mem_total_mb: int = 0
    disk_total_mb: int = 0
    cpu_alloc: float = 0.0  # sum of requested cpu of live sandboxes
    mem_alloc_mb: int = 0
    mem_resident_mb: int = 0  # what sandboxes really hold
    disk_alloc_mb: int = 0
    cpu_busy: float = 0.0  # cores really busy (recent), less what best-effort (SCHED_IDLE) sandboxes use: they give it up at once
    sandboxes: int = 0
    max_sandboxes: int = 0
    concurrency: int = 0
    layers: list[str] = []  # digests of layers cached on this host
    cpu_overcommit: float = 50.0
    mem_overcommit: float = 1.0
    version: int = 1
    cpu_alloc_ls: float = 0.0  # requested cpu of latency-sensitive sandboxes (never overcommitted)
    backends: list[HostBackend] = []  # every backend this host runs; empty (older hosts): only ``backend``
    disk_free_mb: int = 0  # free space in the data dir; 0: not reported (older hosts), a full disk reports 1
    storage_limits: dict[str, int] = {}  # what a sandbox may make this host store, by the names quota_exceeded gives them (0: none)
    upload_bytes: dict[str, int] = {}  # tenant -> bytes its file uploads hold in its sandboxes here (hostagent._uploads)


# A warm-pool container's id starts with this (``SandboxRecord.container_id``); a later generation's
# container is ``<sandbox id>-g<generation>``.
WARM_CONTAINER_PREFIX = "wp-"


class SandboxRecord(Struct, kw_only=True, tag=True):
    """The record of one sandbox, kept in KV ``dsec_sandboxes`` under its id.

    ``state`` is its lifecycle (``SANDBOX_STATES``): ``creating`` (the owning host's claim; ``placed``
    in records of older hosts) -> ``running`` -> ``paused`` -> ``stopping`` (a kill or expiry is under
    way: a durable intent the host retries) -> ``gone`` (everything removed; ``end_reason`` says why;
    ``killed`` in records of older hosts), or ``lost`` (the sandbox vanished behind its host's back),
    or ``failed`` (never started).
    """

    spec: SandboxSpec
    state: SandboxState
    host_id: str = ""
    created_at: float = 0.0
    ready_at: float = 0.0
    expires_at: float = 0.0
    ended_at: float = 0.0
    end_reason: str = ""
    snapshot_id: str = ""  # state paused with persist: the snapshot a resume starts it from, on any host
    # The container (and so cgroup) serving it on its host when that is not named after the sandbox: a
    # warm-pool container (``wp-<hex>``) or a later generation's (``<id>-g<gen>``). Guard maps the
    # kernel's records, which name the cgroup, back to the sandbox by it. "" = the sandbox id.
    container_id: str = ""



class LayerRef(Struct, kw_only=True, tag=True):
    role: str  # base, workspace, toolkit
    digest: str  # sha256:<hex>
    size: int = 0
    kind: str = "dir"  # dir (a local directory), erofs (a blob in the chunk store)
    path: str = ""  # for kind=dir: where the directory is on every host (dev stacks)
    chunks: list[str] = []
    chunk_size: int = 0


class ImageDefaults(Struct, kw_only=True, tag=True):
    """What an OCI image's config (or a Dockerfile's ENV/WORKDIR/USER/ENTRYPOINT/CMD) says a process in
    the template runs with, unless the create or exec says otherwise."""

    env: dict[str, str] = {}
    workdir: str = ""
    user: str = ""
    entrypoint: list[str] = []
    cmd: list[str] = []
    source: str = ""  # where they came from: the image reference with its manifest digest
    # E2B's startCmd / readyCmd (``Template().set_start_cmd``): a create through the gateway starts
    # start_cmd and is answered once ready_cmd exits 0 (sdk._startcmd); "" = none
    start_cmd: str = ""
    ready_cmd: str = ""


class TemplateManifest(Struct, kw_only=True, tag=True):
    """A template: base + workspace + toolkit layers, kept in KV ``dsec_images`` under its name.
    A template pulled from a registry has one ``base`` layer per image layer (lowest first)."""

    name: str
    layers: list[LayerRef]
    created_at: float = 0.0
    description: str = ""
    defaults: ImageDefaults | None = None
    owner: str = ""  # the client that built it through the gateway's template API ("" = the operator's)
    # Tenants that pulled it from a registry (a ``FROM <image>`` pull cache entry, ``--from REF``): its
    # layers count against each one's template bytes, however many others share them (imaged._quota).
    pulled_by: list[str] = []


class Lease(Struct, kw_only=True, tag=True):
    """A client lease in KV ``dsec_leases``, keyed by the owner (one key covers all its sandboxes) or a sandbox id."""

    sandbox_id: str  # the key: the owner's id for an owner lease
    renewed_at: float
    ttl_s: float
    owner: str = ""


class TenantLimits(Struct, kw_only=True, tag=True):
    """A tenant's quotas, in KV ``dsec_tenants`` under its tenant token (``_default``: every client
    tenant without a record). 0: no limit. Counted over its live sandboxes (and creates admitted but
    not yet started), whatever made them: a create, a fork, a restore."""

    max_sandboxes: int = 0
    max_cpu: float = 0.0  # the sum of the sandboxes' ``cpu``
    max_memory_mb: int = 0  # the sum of the sandboxes' ``memory_mb``


class QuotaHold(Struct, kw_only=True, tag=True):
    """One sandbox a tenant's quotas count: what it holds, and when placement admitted it."""

    cpu: float
    memory_mb: int
    at: float


class TenantUsage(Struct, kw_only=True, tag=True):
    """What a limited tenant holds, in KV ``dsec_quota`` under its tenant token: one hold per sandbox
    id, so a redelivered create is counted once; written by placement with compare-and-set."""

    sandboxes: dict[str, QuotaHold] = {}


class SnapshotRecord(Struct, kw_only=True, tag=True):
    """One snapshot, kept in KV ``dsec_snapshots`` under its id: the layers a restore stacks over the
    template's (lowest first; the parent's chain, then this snapshot's own), and where it came from."""

    snapshot_id: str
    sandbox_id: str
    template: str
    created_at: float
    parent_id: str = ""
    name: str = ""
    host_id: str = ""
    layers: list[LayerRef] = []
    bytes_added: int = 0  # bytes this snapshot put into the blob store (new chunks)
    memory: bool = False
    memory_layer: LayerRef | None = None  # CRIU's images, packed as a layer like the files
    metadata: dict[str, str] = {}
    spec: SandboxSpec | None = None  # the source's spec (a persisted pause resumes with it)


# --- security profiles (KV ``dsec_profiles``: guard writes them, host agents enforce them) ---
class SyscallArg(Struct, kw_only=True):
    """One comparison on a system call argument (OCI/libseccomp semantics).

    ``op``: eq, ne, lt, le, gt, ge or masked_eq (``arg & mask == value``). A ``mask`` that fits in
    32 bits compares only the low 32 bits, which is what the kernel itself looks at for ``int``
    arguments such as an ioctl request (set high bits can't dodge the rule).
    """

    index: int
    op: str
    value: int
    mask: int = 0


class SyscallRule(Struct, kw_only=True):
    names: list[str]
    args: list[SyscallArg] = []  # all must hold
    errno: int = 1  # deny rules: the error returned (EPERM)
    comment: str = ""


class SyscallPolicy(Struct, kw_only=True):
    """An allow-list: a call that no rule allows fails with ``default_errno``.

    ``deny`` rules are explicit refusals that are also reported (audit): they are checked before
    the allow rules. ``enosys`` calls fail quietly with ENOSYS so libc falls back (clone3).
    ``native_only`` kills a process that uses another syscall ABI (i386 ``int 0x80``, x32).
    """

    default_errno: int = 1
    allow: list[str] = []
    allow_if: list[SyscallRule] = []
    deny: list[SyscallRule] = []
    enosys: list[str] = []
    native_only: bool = True


class FsPolicy(Struct, kw_only=True):
    """Filesystem access inside the sandbox, enforced with Landlock (holds for root too)."""

    landlock: bool = True
    required: bool = True  # refuse to start the sandbox on a kernel without Landlock
    read_only: list[str] = field(default_factory=lambda: ["/"])  # read and execute beneath these
    writable: list[str] = []  # full access beneath these (created when missing)
    devices: list[str] = []  # read/write/ioctl existing device nodes beneath these
    masked_paths: list[str] = []  # hidden (/proc and /sys entries)
    # Mounted read-only (a read-only bind of the path onto itself; absent from the image: skipped).
    # Unlike Landlock this also refuses metadata changes (chmod, chown, xattrs, times, inode flags).
    # None may hold a writable or device path.
    readonly_paths: list[str] = []


class AuditPolicy(Struct, kw_only=True):
    """What guard does when the sandbox trips a rule: record, kill or quarantine (kill + mark)."""

    seccomp: str = "record"
    landlock: str = "record"  # also kind "fs": a read-only system path refused the write first
    other: str = "record"  # network, control-plane, disk and other reported kinds


class SecurityProfile(Struct, kw_only=True, tag=True):
    """A named, versioned security profile, kept in KV ``dsec_profiles`` under its name."""

    name: str
    version: int = 1
    description: str = ""
    fs: FsPolicy = field(default_factory=FsPolicy)
    syscalls: SyscallPolicy = field(default_factory=SyscallPolicy)
    capabilities: list[str] = []
    no_new_privileges: bool = True
    audit: AuditPolicy = field(default_factory=AuditPolicy)
    updated_at: float = 0.0


# --- live sandbox ops (core request/reply on dsec.sbx.<id>.<op>) ------------------------
class ExecRequest(Struct, kw_only=True, tag=True):
    """Run ``cmd`` with ``/bin/sh -c`` (request on ``dsec.sbx.<id>.exec``).

    Output: when ``stream_to`` (a client inbox) is set, every byte goes there as ``ExecChunk``
    messages numbered from 0 across both streams, before the reply. Flow control (``acks``): the
    client answers each chunk marked ``ack`` with a ``StreamAck`` on ``dsec.sbx.<id>.ack``; the
    host keeps a bounded window of unanswered ones (so a slow client slows the command instead of
    NATS dropping output) and stops streaming to an inbox that does not answer (the client then
    sees fewer chunks than ``ExecResult.chunks``). Without ``acks`` nothing is marked or waited
    for: output may be lost on the way (the numbering shows where). The reply is an
    ``ExecResult`` holding at most ``output_cap`` bytes of each stream (the head), cut further to
    fit the server's payload limit, with the totals and ``*_truncated`` flags.

    ``background``: the reply is ``ProcessStarted`` at once; output then streams to ``stream_to``
    and the final ``ExecResult`` (no output bytes, only totals) is the stream's last message. The
    process outlives the request; it is driven with ``Proc*`` requests on ``dsec.sbx.<id>.proc``.
    """

    cmd: str
    envs: dict[str, str] = {}
    cwd: str = ""
    timeout_s: float = 60.0  # 0: no limit
    stream_to: str = ""  # when set, ExecChunk messages go here before the reply
    background: bool = False
    user: str = ""  # run as this user of the sandbox's /etc/passwd (name or uid); "": the agent's (root)
    stdin: bool = False  # give the process a stdin pipe (ProcInput writes to it); else /dev/null
    tag: str = ""  # a client-chosen name of a background process (ProcSelector.tag)
    output_cap: int = -1  # bytes of each stream kept in the ExecResult; -1: the host's default (8 MiB)
    acks: bool = False  # the client answers chunks marked ack (flow control, see above)
    # A grader's run that what the sandbox's processes wrote cannot hijack: fresh private HOME,
    # fixed PATH of system directories, only ``envs`` on a fixed minimal set (no sandbox envs), no
    # user site-packages or startup files; refused (not_supported) where system dirs are writable.
    trusted: bool = False
    # The trajectory log (bus.messages.TrajStep): the client's step number (-1: not logged) and who it is.
    step: int = -1
    client_id: str = ""


class ExecChunk(Struct, kw_only=True, tag=True):
    seq: int  # 0, 1, 2, ... per stream_to inbox, both streams together: a gap means lost output
    stream: int  # 1 stdout, 2 stderr
    data: bytes
    pid: int = 0
    ack: bool = False  # answer with StreamAck(stream_id=<this inbox>, seq=seq)


class StreamAck(Struct, kw_only=True, tag=True):
    """A client's flow-control answer (published, no reply, on ``dsec.sbx.<id>.ack``) to an
    ``ExecChunk`` or ``FsEvent`` marked ``ack``: everything up to ``seq`` arrived."""

    stream_id: str  # the stream_to inbox
    seq: int


class ExecResult(Struct, kw_only=True, tag=True):
    exit_code: int  # 128+signal when killed by a signal
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    chunks: int = 0  # how many ExecChunk were published (to this inbox) before this message
    duration_ms: float = 0.0
    stdout_bytes: int = 0  # everything the command wrote, kept or not
    stderr_bytes: int = 0
    stdout_truncated: bool = False  # stdout holds only the first part of the output
    stderr_truncated: bool = False
    pid: int = 0  # in the sandbox's pid namespace
    signal: int = 0  # the signal that ended the process (0: it exited)


class ProcessStarted(Struct, kw_only=True, tag=True):
    """Reply to a background ``ExecRequest`` and to ``ProcConnect``."""

    pid: int
    tag: str = ""


# --- background processes (core request/reply on dsec.sbx.<id>.proc) --------------------------
# A process is named by ``pid`` (in the sandbox) or, when pid is 0, by the ``tag`` it was started with.
class ProcessInfo(Struct, kw_only=True):
    """A running background process (a nested value)."""

    pid: int
    cmd: str
    tag: str = ""
    cwd: str = ""
    user: str = ""
    envs: dict[str, str] = {}
    started_at: float = 0.0
    stdin: bool = False


class ProcList(Struct, kw_only=True, tag=True):
    pass


class ProcessList(Struct, kw_only=True, tag=True):
    processes: list[ProcessInfo] = []


class ProcSignal(Struct, kw_only=True, tag=True):
    """Send ``signal`` to the process's group (-> ``Done``)."""

    pid: int = 0
    tag: str = ""
    signal: int = 9


class ProcInput(Struct, kw_only=True, tag=True):
    """Write ``data`` to the process's stdin pipe; ``close`` closes it after (-> ``Done``)."""

    pid: int = 0
    tag: str = ""
    data: bytes = b""
    close: bool = False


class ProcConnect(Struct, kw_only=True, tag=True):
    """Stream the process's output from now on to ``stream_to`` (-> ``ProcessStarted``), like a
    background ``ExecRequest`` does; a process that already ended sends just its ``ExecResult``."""

    pid: int = 0
    tag: str = ""
    stream_to: str = ""
    acks: bool = False  # as ExecRequest.acks


class ProcDisconnect(Struct, kw_only=True, tag=True):
    """Stop streaming to ``stream_to``; the process keeps running (-> ``Done``)."""

    pid: int = 0
    tag: str = ""
    stream_to: str = ""


ProcOp = ProcList | ProcSignal | ProcInput | ProcConnect | ProcDisconnect


class FileWrite(Struct, kw_only=True, tag=True):
    path: str
    data: bytes
    offset: int = 0
    truncate: bool = True
    mode: int = 0o644
    # Set before the data is written (the first chunk of a file carries them): the owner (-1: as is)
    # and the metadata (the file's user.e2b.<key> xattrs become exactly these; None: left alone).
    uid: int = -1
    gid: int = -1
    metadata: dict[str, str] | None = None
    # The trajectory log (bus.messages.TrajStep): the client's step number (-1: not logged) and who it is.
    step: int = -1
    client_id: str = ""
    # The size the whole upload reaches, when the writer knows it (-1: not known): the first chunk
    # reserves it under the tenant's upload bound (hostagent._uploads), so an upload over the bound
    # is refused before any of it is written.
    size: int = -1


class FileRead(Struct, kw_only=True, tag=True):
    path: str
    offset: int = 0
    length: int = -1


class FileList(Struct, kw_only=True, tag=True):
    path: str
    long: bool = False  # as FileStat.long


class FileRemove(Struct, kw_only=True, tag=True):
    path: str
    # The trajectory log (bus.messages.TrajStep): the client's step number (-1: not logged) and who it is.
    step: int = -1
    client_id: str = ""


class FileExists(Struct, kw_only=True, tag=True):
    path: str


class FileMakeDir(Struct, kw_only=True, tag=True):
    """Create ``path`` and missing parents (-> ``DirMade``; created=False when it existed)."""

    path: str
    mode: int = 0o755
    # The trajectory log (bus.messages.TrajStep): the client's step number (-1: not logged) and who it is.
    step: int = -1
    client_id: str = ""


class FileRename(Struct, kw_only=True, tag=True):
    """Move ``path`` to ``new_path`` (-> ``FileInfo`` of the new path)."""

    path: str
    new_path: str
    # The trajectory log (bus.messages.TrajStep): the client's step number (-1: not logged) and who it is.
    step: int = -1
    client_id: str = ""


class FileStat(Struct, kw_only=True, tag=True):
    path: str
    follow_symlinks: bool = True
    long: bool = False  # with owner, symlink target and metadata (EntryInfo's uid ... metadata)


class FileWatch(Struct, kw_only=True, tag=True):
    """Stream changes beneath directory ``path`` (inotify) to ``stream_to`` as ``FsEvent``
    messages (-> ``WatchStarted``). Flow control as for exec output, always on: events marked
    ``ack`` are answered with ``StreamAck``; the host sends a marked one (a keepalive when nothing
    changes) at least every 10 s and ends a watch whose client stopped answering."""

    path: str
    stream_to: str
    recursive: bool = False


class FileUnwatch(Struct, kw_only=True, tag=True):
    watch_id: str


FileOp = FileWrite | FileRead | FileList | FileRemove | FileExists | FileMakeDir | FileRename | FileStat | FileWatch | FileUnwatch


class EntryInfo(Struct, kw_only=True):
    """A directory entry (a nested value, not a payload of its own)."""

    name: str
    path: str
    type: str  # file, dir, symlink, other
    size: int = 0
    mode: int = 0
    mtime: float = 0.0
    uid: int = -1  # -1: not reported (a listing or stat without ``long``)
    gid: int = -1
    symlink_target: str = ""  # what a symlink points to, as stored
    metadata: dict[str, str] = {}  # the user.e2b.<key> xattrs (key without the prefix)


class FileData(Struct, kw_only=True, tag=True):
    data: bytes
    size: int  # the whole file's size
    offset: int = 0


class FileListing(Struct, kw_only=True, tag=True):
    entries: list[EntryInfo]


class FileWritten(Struct, kw_only=True, tag=True):
    path: str
    size: int
    attrs: bool = False  # the FileWrite's uid/gid/metadata were applied (an older host or agent ignores them)


class Exists(Struct, kw_only=True, tag=True):
    exists: bool


class DirMade(Struct, kw_only=True, tag=True):
    path: str
    created: bool


class FileInfo(Struct, kw_only=True, tag=True):
    entry: EntryInfo


class WatchStarted(Struct, kw_only=True, tag=True):
    watch_id: str


class FsEvent(Struct, kw_only=True, tag=True):
    """One change seen by a ``FileWatch`` (on its stream_to inbox)."""

    seq: int  # 0, 1, 2, ... per watch: a gap means lost events
    watch_id: str
    kind: str  # create, write, remove, rename, chmod; keepalive (no change, only the flow-control beat); end (the watch stopped)
    name: str = ""  # path relative to the watched directory
    path: str = ""  # absolute path in the sandbox
    is_dir: bool = False
    ack: bool = False  # answer with StreamAck(stream_id=<this inbox>, seq=seq)


class KillRequest(Struct, kw_only=True, tag=True):
    reason: str = "user"


class SetTimeout(Struct, kw_only=True, tag=True):
    timeout_s: float


class SetNetwork(Struct, kw_only=True, tag=True):
    """Replace a running sandbox's egress allowlist (None or an empty one: no egress). Only a sandbox
    created with a network (a non-empty allowlist) has one to change."""

    network: NetworkSpec | None = None


class InfoRequest(Struct, kw_only=True, tag=True):
    pass


class SandboxInfo(Struct, kw_only=True, tag=True):
    sandbox_id: str
    state: SandboxState
    host_id: str
    template: str
    started_at: float
    expires_at: float
    metadata: dict[str, str] = {}
    pid: int = 0
    cpu_class: str = ""  # the CPU class its cgroup is in: its priority
    mem_resident_bytes: int = 0  # from the host's reclaim service's last report (0: none yet, or none running)
    mem_reclaimed_bytes: int = 0
    mem_merged_bytes: int = 0


MAX_FORK_COUNT = 100  # sandboxes one fork may start


class SnapshotRequest(Struct, kw_only=True, tag=True):
    """On ``dsec.sbx.<id>.snapshot``; ``snapshot_id`` (client-chosen) makes a retried request idempotent.
    ``fork_ids``: the sandboxes the client starts from it (a fork), named in the ``forked`` event."""

    snapshot_id: str = ""
    name: str = ""
    memory: bool = False
    metadata: dict[str, str] = {}
    fork_ids: list[str] = []
    # The trajectory log (bus.messages.TrajStep): the client's step number (-1: not logged) and who it is.
    step: int = -1
    client_id: str = ""


class PauseRequest(Struct, kw_only=True, tag=True):
    """On ``dsec.sbx.<id>.pause``: freeze in place, or (``persist``) snapshot with memory and free the host."""

    persist: bool = False
    snapshot_id: str = ""
    memory: bool = False  # with persist: the processes too (CRIU), so a resume carries on where they were


class ResumeRequest(Struct, kw_only=True, tag=True):
    """On ``dsec.sbx.<id>.resume``: thaw a frozen sandbox."""


class PackDirectory(Struct, kw_only=True, tag=True):
    """On ``bus.subjects.host_pack(host)``: pack a directory on that host into an EROFS layer in the blob
    store, as it is (whiteouts, opaque dirs, xattrs, modes, owners and times kept)."""

    path: str
    role: str = "snapshot"


class PackedLayer(Struct, kw_only=True, tag=True):
    ref: LayerRef
    uploaded_bytes: int = 0
    seconds: float = 0.0


class RemoveSnapshot(Struct, kw_only=True, tag=True):
    """On ``bus.subjects.SNAP_REMOVE``: delete a snapshot nothing builds on, and its unshared chunks."""

    snapshot_id: str


class Done(Struct, kw_only=True, tag=True):
    """A plain success reply."""

    detail: str = ""


# Done.detail of a kill: finished, or still under way on the host (a durable intent it retries;
# asking again waits for it again).
KILL_DONE = "killed"
KILL_PENDING = "stopping"


# --- sandbox ports (core request/reply on dsec.sbx.<id>.port) ------------------------------------
# A TCP connection to a server inside the sandbox, opened by its host agent in the sandbox's network
# namespace and relayed over NATS (the gateway's sandbox ports): the sandbox's network stays closed.
class PortOpen(Struct, kw_only=True, tag=True):
    """Connect to ``127.0.0.1:port`` inside the sandbox; the bytes it sends come as PortData on ``to``
    (a reply inbox). Reply: PortOpened."""

    port: int
    to: str


class PortOpened(Struct, kw_only=True, tag=True):
    conn: str  # names the connection in PortSend


class PortSend(Struct, kw_only=True, tag=True):
    """Bytes for the sandbox's server (reply Done once written); ``eof`` closes our sending side,
    ``close`` the whole connection."""

    conn: str
    data: bytes = b""
    eof: bool = False
    close: bool = False


class PortData(Struct, kw_only=True, tag=True):
    """Bytes from the sandbox's server, in ``seq`` order; ``eof`` ends them (``error`` says why when
    the connection failed)."""

    conn: str
    seq: int
    data: bytes = b""
    eof: bool = False
    error: str = ""


PortOp = PortOpen | PortSend
class MetricsRequest(Struct, kw_only=True, tag=True):
    """Request on ``dsec.sbx.<id>.metrics``."""


class SandboxMetrics(Struct, kw_only=True, tag=True):
    """A sandbox's resource use, from its cgroups and scratch disk."""

    at: float
    cpu_count: float = 0.0  # cores it may use (its cpu limit)
    cpu_used_pct: float = 0.0  # of cpu_count, since the previous metrics request (or over a short sample)
    cpu_usage_s: float = 0.0  # CPU time used since it started
    mem_used_bytes: int = 0
    mem_total_bytes: int = 0  # its memory limit
    disk_used_bytes: int = 0
    disk_total_bytes: int = 0



# --- a sandbox's screen (core request/reply on dsec.sbx.<id>.display) ------------------------------
DisplayAction = Literal["screenshot", "type", "key", "click"]
MouseButton = Literal["left", "right", "middle"]


class DisplayRequest(Struct, kw_only=True, tag=True):
    """Request on ``dsec.sbx.<id>.display``, for a sandbox with a screen (``backend="vm"``; any other
    answers ``not_supported``). ``screenshot`` answers ``Screenshot``; ``type`` types ``text``,
    ``key`` presses ``key`` (a name, modifiers joined with ``+``: ``"enter"``, ``"ctrl+c"``) and
    ``click`` clicks ``button`` at (``x``, ``y``) in screenshot pixels; those answer ``Done``."""

    action: DisplayAction
    text: str = ""
    key: str = ""
    x: int = 0
    y: int = 0
    button: MouseButton = "left"


class Screenshot(Struct, kw_only=True, tag=True):
    """The screen as a PNG image."""

    png: bytes


# --- image cache stats (core request/reply on dsec.img.host.<host>.stats) ----------------------------
class LayerCacheStats(Struct, kw_only=True):
    """One layer as this host's lazy loader sees it (a nested value)."""

    digest: str  # sha256:<hex>
    total_bytes: int
    fetched_bytes: int  # bytes of this layer's chunks present in the local cache
    chunks: int = 0
    cached_chunks: int = 0


class HostImageStatsRequest(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.host_img_stats(host_id)``; empty digests = every known layer."""

    digests: list[str] = []


class HostImageStats(Struct, kw_only=True, tag=True):
    """Reply from a host's lazy loader (core request/reply on ``host_img_stats(host_id)``)."""

    host_id: str
    at: float
    mode: str = "lazy"  # lazy | prefetch
    pid: int = 0
    layers: list[LayerCacheStats] = []
    cache_bytes: int = 0  # bytes of chunks on local disk
    max_cache_bytes: int = 0
    downloaded_bytes: int = 0  # fetched from the blob store since the daemon started
    cache_written_bytes: int = 0  # written to the local cache since the daemon started
    evicted_bytes: int = 0
    fetch_failures: int = 0
    corrupt_chunks: int = 0




# --- image service (core request/reply on dsec.img.*) ------------------------------------------------
class ListImages(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_LIST``."""


class ImageList(Struct, kw_only=True, tag=True):
    templates: list[TemplateManifest] = []


class BuildImage(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_BUILD``: sources are paths on the image service's machine,
    ``layer:<digest>`` or ``template:<name>``."""

    name: str
    base: str
    workspace: str = ""
    toolkit: str = ""
    description: str = ""
    from_ref: str = ""  # an image in a registry (``[host/]repo[:tag][@sha256:...]``), instead of ``base``
    platform: str = ""  # of ``from_ref``: ``os/arch[/variant]``, default this machine's
    # a template made of layers that exist already: a snapshot's (its template's layers, then the
    # snapshot's chain; how a Dockerfile build ends) or another template's, with new defaults
    from_snapshot: str = ""
    from_template: str = ""
    defaults: ImageDefaults | None = None
    owner: str = ""  # written into the manifest (the gateway's template API: only the owner rebuilds or removes it)


class ImageBuilt(Struct, kw_only=True, tag=True):
    manifest: TemplateManifest
    uploaded_bytes: int = 0
    seconds: float = 0.0


class RemoveImage(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_REMOVE``."""

    name: str
    prune: bool = False


class ImageStatsRequest(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_STATS``: a template's size and layers."""

    name: str


class ImageStats(Struct, kw_only=True, tag=True):
    name: str
    total_bytes: int
    layers: list[LayerRef] = []


# --- Prometheus metrics of the services (core request/reply, dsec.metrics.>) ----------------
class ScrapeRequest(Struct, kw_only=True, tag=True):
    """Asks processes for their Prometheus metrics (scatter-gather on ``dsec.metrics.scrape``)."""


class ScrapeReply(Struct, kw_only=True, tag=True):
    service: str
    instance: str
    text: str  # Prometheus text exposition 0.0.4, every sample labelled with service and instance
    at: float = 0.0



# --- FnCall: stateless calls served from per-template warm pools (core request/reply) -------------
FN_OUTPUT_CAP = 1 << 20  # bytes of each stream a call's result keeps by default


class FnFile(Struct, kw_only=True):
    """A file a call writes into its working directory before it runs (a nested value)."""

    path: str  # relative to the call's working directory, never climbing out of it
    data: bytes
    mode: int = 0o644


class FnCallRequest(Struct, kw_only=True, tag=True):
    """One stateless call on ``dsec.fn.<template>.call`` (a queue group every host with a warm pool
    of ``template`` subscribes to): a pool member that never served a call runs ``compile_cmd`` (when
    set, and only on its success) then ``cmd`` in ``bus.fncall.FN_WORKDIR`` with ``files`` written there first,
    and is then replaced. A call that finds no free member waits up to ``queue_s`` for one, then
    ``no_capacity``."""

    cmd: str
    files: list[FnFile] = []
    envs: dict[str, str] = {}
    timeout_s: float = 30.0
    compile_cmd: str = ""
    compile_timeout_s: float = 10.0
    memory_mb: int = 0  # 0: the pool's own limit
    stdin: bytes = b""  # fed to ``cmd`` (not to the compile step)
    fetch_files: list[str] = []  # paths (relative to the working directory) whose contents come back
    output_cap: int = FN_OUTPUT_CAP
    queue_s: float = 10.0
    trusted: bool = False  # run as a trusted (grader) run: ExecRequest.trusted, where the host has it


class FnCallResult(Struct, kw_only=True, tag=True):
    run: ExecResult | None = None  # None: the compile step failed (or timed out), so nothing ran
    compile: ExecResult | None = None
    oom: bool = False  # the call's memory limit was hit (the kernel killed a process of it)
    files: dict[str, bytes] = {}  # fetched files that existed
    host_id: str = ""
    queued_ms: float = 0.0  # waited for a free pool member


# --- trajectories (JetStream, DSEC_TRAJ on dsec.traj.<tenant>.<sandbox>) -------------------------------
class TrajStep(Struct, kw_only=True, tag=True):
    """One logged operation on a sandbox, published by its host before the reply is sent (acked just after it).

    ``request`` is the request as the client sent it without what differs between two runs of the
    same step (inboxes, step, client; bus.trajectory.normalize), ``digest`` its sha256. ``result``
    the encoded reply (or ``error_code``/``error``); command output and written data beyond the log's
    cap keep only their head, with the whole one's sha256 in ``digests`` (``stdout``, ``stderr``, ``data``).
    """

    sandbox_id: str
    client_id: str
    step: int
    op: str  # the subject's op: exec, files, snapshot
    kind: str  # the request's type: ExecRequest, FileWrite, ...
    digest: str
    request: bytes = b""
    result: bytes = b""
    error_code: str = ""
    error: str = ""
    digests: dict[str, str] = {}
    started_at: float = 0.0
    duration_ms: float = 0.0
    host_id: str = ""
    # op "model": a policy's turn (request and response bodies as JSON, client "<job>-model", step = turn)
    policy_version: str = ""


# --- rollouts (work queue DSEC_ROLLOUTS on dsec.rollout.<queue>; state in KV dsec_rollouts) -----------
RolloutState = Literal["queued", "running", "waiting_policy", "done", "failed"]
ROLLOUT_TOOLS = ("exec", "read_file", "write_file")


class RolloutJob(Struct, kw_only=True, tag=True):
    """An agent loop to run: ask the policy (an OpenAI-compatible chat-completions endpoint) for the
    next action, run its tool calls in a sandbox of ``template``, until it answers without a tool
    call or ``max_steps`` answers were acted on."""

    job_id: str
    task: str
    policy_url: str  # the endpoint's base (``.../v1``) or its ``/chat/completions`` URL
    template: str = "base"
    max_steps: int = 20
    tools: list[str] = field(default_factory=lambda: list(ROLLOUT_TOOLS))
    metadata: dict[str, str] = {}
    model: str = ""
    system_prompt: str = ""
    pool: str = "default"
    sandbox_timeout_s: float = 3600.0
    policy_timeout_s: float = 60.0  # one request; three in a row time out: policy_timeout
    policy_wait_s: float = 600.0  # how long an unreachable policy is waited for (with back-off)
    submitted_at: float = 0.0
    pause_while_waiting: bool = False  # freeze the sandbox while the policy is unreachable (thawed when it answers)
    # Whose job it is: the tenant token of the subject it was submitted on (the worker binds it to
    # that, and refuses a job that names another tenant: bus.subjects.rollout_job).
    tenant: str = ""
    memory_mb: int = 0  # the job's sandbox's size; 0: the create's defaults
    cpu: float = 0.0


class RolloutRecord(Struct, kw_only=True, tag=True):
    """A job's state (KV ``dsec_rollouts``, key: ``<tenant>.<job id>``), stored before each sandbox step runs
    and after it answered: ``messages`` is the conversation so far (OpenAI chat format),
    ``sandbox_steps`` the sandbox client's step count when it was stored (steps past it are in the
    trajectory log: a worker taking over fast-forwards through them)."""

    job: RolloutJob
    state: RolloutState = "queued"
    sandbox_id: str = ""
    messages: list[dict[str, Any]] = []
    sandbox_steps: int = 0
    turns: int = 0  # policy answers acted on
    finish_reason: str = ""  # stop (an answer without tool calls) or max_steps
    error_code: str = ""
    error: str = ""
    worker: str = ""
    deliveries: int = 0  # workers that took the job up
    policy_retries: int = 0
    updated_at: float = 0.0
    finished_at: float = 0.0


class ModelCall(Struct, kw_only=True, tag=True):
    """On ``dsec.model.<tenant>.<job>``: an OpenAI chat-completions request body for the job's policy (the
    gateway's ``/rollouts/<job>/v1/chat/completions``); answered with a ``ModelAnswer``."""

    job_id: str
    body: bytes


class ModelAnswer(Struct, kw_only=True, tag=True):
    status: int  # the policy's HTTP status
    body: bytes
    policy_version: str = ""


# --- memory reclaim (core publish on bus.subjects.reclaim_targets / reclaim_report) ---------------
class ReclaimTarget(Struct, kw_only=True):
    """One live sandbox as its host agent describes it to the reclaim service (a nested value)."""

    sandbox_id: str
    cgroup: str  # its cgroup path under each v1 hierarchy (``/dsec/<container id>``); "" when it has none
    priority: PriorityField = "best-effort"
    memory_mb: int = 0  # its limit
    idle_s: float = 0.0  # since its last operation (exec, files, ...) or its start
    state: str = "running"  # running | paused | stopping: only running sandboxes are reclaimed


class ReclaimTargets(Struct, kw_only=True, tag=True):
    host_id: str
    at: float
    sandboxes: list[ReclaimTarget] = []


class SandboxMemory(Struct, kw_only=True):
    """One sandbox's memory as the reclaim service sees it (a nested value)."""

    sandbox_id: str
    resident_bytes: int = 0  # charged to its cgroup now (anonymous + page cache)
    reclaimed_bytes: int = 0  # taken from it by the service so far (page cache dropped, anonymous to swap)
    swapped_bytes: int = 0  # its pages in (compressed) swap now
    merged_bytes: int = 0  # its pages KSM merged with identical ones
    idle_s: float = 0.0
    cpu_class: str = ""  # best-effort | latency-sensitive


class ReclaimReport(Struct, kw_only=True, tag=True):
    """A reclaim pass's figures (``enabled`` False: the service runs but reclaims nothing)."""

    host_id: str
    at: float
    enabled: bool = True
    sandboxes: list[SandboxMemory] = []
    resident_bytes: int = 0
    reclaimed_bytes: int = 0
    swap_device: str = ""  # what the service swaps to ("" none: page cache only)
    swap_used_bytes: int = 0  # pages held in swap (uncompressed)
    swap_stored_bytes: int = 0  # what they take in memory compressed (zram), 0 when unknown
    merged_bytes: int = 0  # memory KSM saves (pages_sharing)


__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, Struct)] + [
    "ReqMessage",
    "HostMessage",
    "EventMessage",
    "FileOp",
    "PortOp",
    "ProcOp",
    "Priority",
    "Backend",
    "BackendName",
    "BackendField",
    "PriorityField",
    "SandboxState",
    "TenantLimits",
    "QuotaHold",
    "TenantUsage",
    "SandboxLiveState",
    "SandboxEndedState",
    "SandboxEventKind",
    "HostState",
    "HostEventKind",
    "SnapshotEventKind",
    "DisplayAction",
    "MouseButton",
    "ImageEventKind",
    "RolloutState",
    "ROLLOUT_TOOLS",
    "ViolationAction",
    "HandoffState",
    "BACKENDS",
    "PRIORITIES",
    "HandoffReply",
    "ReadyMany",
    "CreateReply",
    "SANDBOX_STATES",
    "SANDBOX_ENDED",
    "KILL_DONE",
    "KILL_PENDING",
    "WARM_CONTAINER_PREFIX",
]
