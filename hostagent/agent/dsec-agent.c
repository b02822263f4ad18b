/*
 * dsec-agent: PID 1 inside every dsec sandbox. It runs commands and touches files on behalf of the
 * host, so every path it is given resolves in the sandbox's own root and mount namespace.
 *
 *   dsec-agent --socket PATH [--heartbeat-ms N] [confinement options]
 *
 * Confinement (the host agent passes these from the sandbox's guard profile; applied to the agent
 * itself after its socket is bound and before it serves anything, so every exec'd command and
 * every file operation inherits them -- there is no moment when user code runs unconfined):
 *   --landlock-ro PATH    read and execute beneath PATH
 *   --landlock-rw PATH    full access beneath PATH (created if missing); no device nodes
 *   --landlock-dev PATH   read, write, truncate and device ioctls on existing nodes beneath PATH
 *   --landlock-required   exit instead of running unconfined when the kernel lacks Landlock
 *   --seccomp-bpf HEX     a classic-BPF seccomp program (struct sock_filter, native byte order,
 *                         hex) installed with SECCOMP_FILTER_FLAG_LOG on top of the runtime's
 *                         filter, so the calls it refuses are reported to the kernel audit log
 *   --allow-setuid        do not set no_new_privs: setuid programs (sudo) keep working in the commands.
 *                         Installing our filter (and Landlock) without it needs CAP_SYS_ADMIN, which
 *                         the host then lends us for that alone:
 *   --setup-cap N         capability N is dropped from every set, the bounding set included, once we
 *                         are confined and before we serve anything (we exit if that fails), so no
 *                         command can ever hold it
 *   --audit-loginuid N    set our audit login uid (only possible while it is unset): the kernel
 *                         then gives this sandbox its own audit session id, inherited by every
 *                         process in it and unchangeable from inside, which is how the host maps
 *                         an audit record of an already-exited process back to its sandbox
 *   --confine-on-claim    a warm container's agent (started ahead of the sandbox it will serve):
 *                         everything above is applied only when the host sends 'c' (confine), after
 *                         it has given the container its final root (a fork's child gets the
 *                         restore's root by pivot_root: Landlock rules bind to the inodes of the
 *                         root the paths resolve in when they are applied). Until then the agent
 *                         answers nothing but 'P' and 'c' (EACCES): nothing runs in the container
 *                         and no file is touched before it is confined. The agent is single-threaded
 *                         and has no children then, so restricting itself restricts everything it
 *                         will ever start, exactly as at a cold start.
 * Landlock uses the best ABI the kernel offers (2: REFER, 3: TRUNCATE, 5: IOCTL_DEV, 6: signal and
 * abstract-socket scoping, 7: audit logging of denials of exec'd programs). The ping reply reports
 * what was applied.
 *
 * Single-threaded epoll loop; signals arrive through a signalfd (SIGCHLD reaps every zombie, which
 * matters as PID 1; SIGTERM/SIGINT kill running exec process groups and exit 0). A pid in this
 * protocol is one the agent started (in the sandbox's pid namespace): other processes are not
 * found, so a signal or stdin write can never reach the agent itself or a stranger.
 *
 * ---------------------------------------------------------------------------------------------
 * Wire protocol (unix stream socket, one request at a time per connection)
 *
 *   frame := u32 len | u8 type | payload      len counts type + payload; big-endian; 1..8 MiB
 *   u8/u32/u64/i32/i64 are big-endian; str := u32 n | n bytes (must not contain NUL)
 *
 * The client sends one request frame; the agent answers with one or more frames. From protocol 3
 * on, the connection then takes the next request (a host keeps connections to reuse: no connect
 * and accept per exec); a watch keeps its connection to itself, and a malformed request (bad
 * length, unknown type, bad fields) is answered and the connection closed. The client may close
 * a connection whenever it likes.
 *
 *   'P' ping                                            -> 'K' u32 protocol_version
 *              | u32 landlock_abi (0: none) | u32 confinement flags (1 Landlock enforced,
 *                2 seccomp log filter installed, 4 audit session set)   (older agents: version only)
 *   'c' confine (--confine-on-claim only)               -> 'K' as 'P', after applying the
 *              confinement; again once confined: 'K' at once (idempotent). An agent that cannot
 *              apply it exits, as it would at a cold start.
 *   'X' exec   u32 timeout_ms (0 = none) | str cmd | str cwd ("" = agent's cwd, or the user's home)
 *              | u32 n | n * str "KEY=VALUE"   (n = 0: PATH and HOME defaults)
 *              | u8 flags (1 background, 2 stdin pipe, 4 buffered: output may wait for the exit, a
 *                heartbeat or 1 MiB, for a client that wants only the result; protocol 3)
 *              | str user ("" = ours; name or uid from the sandbox's /etc/passwd, whose
 *                HOME/USER/LOGNAME replace the given ones)
 *              -> first          'i' u32 pid       (the command runs; ESRCH error: unknown user;
 *                                a buffered command's goes out with what follows it)
 *                 any number of  'O' u8 stream (1 stdout, 2 stderr) | bytes   (up to 64 KiB each)
 *                                'H'        (heartbeat after 5 s, or --heartbeat-ms, without a frame)
 *                 then           'E' i32 exit_code (128+signal if killed) | u8 timed_out | u8 signal
 *              The client closing the connection before 'E' kills the command's process group,
 *              unless it runs in the background: then it carries on, its output is discarded
 *              until a client attaches, and an ended one keeps its exit status (the last 64)
 *              for an attach. 'E' follows the shell's exit, not EOF on its pipes: output already
 *              buffered is sent, but background children that keep the pipes open don't delay it.
 *   'T' trusted exec: as 'X' (same fields, same answers; protocol 4), for a grader's command that
 *              what the sandbox's own processes wrote must not hijack. The command gets a fresh
 *              private HOME (created 0700 and empty under /tmp, removed when the shell exits, and
 *              /tmp's mtime put back unless something else changed it meanwhile; the default
 *              cwd), PATH of the existing system directories, and only the given variables
 *              on top of a fixed set (HOME, USER, LOGNAME, PATH, LANG, PYTHONNOUSERSITE,
 *              PYTHONDONTWRITEBYTECODE, GIT_CONFIG_GLOBAL=/dev/null, GIT_CONFIG_NOSYSTEM): no
 *              PYTHONPATH, PYTHONSTARTUP, BASH_ENV, ENV, LD_PRELOAD, ... unless the caller names
 *              them. /bin/sh -c reads no startup file without ENV. Refused (ENOTSUP) without a
 *              writable /tmp for the HOME, and unless every
 *              system directory (/usr /bin /sbin /lib* /etc) is on a read-only mount: with a
 *              writable /etc (ld.so.preload, ld.so.cache, python's sitecustomize, profile.d) or
 *              /usr no environment makes a run trustworthy, and we cannot mount over them.
 *              Agents before protocol 4 answer 'T' with EPROTO (unknown request), never run it
 *              as an ordinary command.
 *   'A' attach u32 pid   -> as 'X' from 'i' on (EBUSY: another client is attached; ESRCH)
 *   'I' stdin  u32 pid | u8 flags (1 = close after) | data (rest)   -> 'K'   (queued; EPIPE when
 *              stdin is closed or was never a pipe, EAGAIN beyond 8 MiB unread)
 *   'U' signal u32 pid | u32 signo   -> 'K'   (to the command's process group; ESRCH)
 *   'J' procs                        -> 'j' u32 n | n * (u32 pid | u8 flags (1 background,
 *                                        2 stdin open, 4 attached) | str cmd | str cwd | str user)
 *   'W' write  u64 offset | u8 flags (1 = truncate) | u32 mode | str path | data (rest of frame)
 *              -> 'Z' u64 file size afterwards.  Creates missing parent dirs (0755); mode is
 *                 applied (umask-free) only when the file is created.
 *   'G' read   u64 offset | u64 length | str path      -> 'D' u64 file size | data (<= 4 MiB)
 *   'L' list   str path                                -> 'T' u32 n | n * entry     (lstat)
 *   'M' remove str path                                -> 'K'          (recursive for dirs)
 *   'Q' exists str path                                -> 'B' u8       (lstat: a dangling link exists)
 *   'S' stat   u8 follow_symlinks | str path           -> 'N' entry    (entry name is "")
 *   'C' mkdir  u32 mode | str path                     -> 'B' u8 created (parents made; 0: it was a dir)
 *   'V' rename str from | str to                       -> 'K'          (missing parents of `to` made)
 *   'Y' watch  u8 recursive | str dir  -> 'w', then any number of 'F' u32 inotify mask | str name
 *              (relative to dir) until the client closes the connection
 *   'a' write with attributes: u64 offset | u8 flags (1 truncate, 2 chown, 4 replace metadata)
 *              | u32 mode | u32 uid | u32 gid | u32 n | n * (str key | str value) | str path | data
 *              -> 'Z' as 'W'. Owner and metadata (the user.e2b.<key> xattrs, all others of that
 *                 namespace removed) are set before the data is written, so a watcher sees create,
 *                 attrib, modify (the kernel merges the consecutive attrib events).
 *   'l' list   str path                                -> 't' u32 n | n * xentry   (lstat)
 *   's' stat   u8 follow_symlinks | str path           -> 'n' xentry   (entry name is "")
 *   ('a', 'l' and 's' came after protocol 3; an older agent answers them EPROTO)
 *
 *   entry := str name | u8 kind (0 other, 1 file, 2 dir, 3 symlink) | u64 size
 *            | u32 mode (permission bits, 07777) | i64 mtime_ns
 *   xentry := entry | u32 uid | u32 gid | str symlink target ("" unless a symlink)
 *            | u32 n | n * (str key | str value)   (the user.e2b.<key> xattrs, prefix removed)
 *
 * Any request may instead be answered by  'R' u32 errno | str message,  after which the agent
 * closes.  A malformed frame gets 'R' EPROTO (EMSGSIZE if too long); the agent never exits on
 * bad input.  Read/write only accept regular files, so a FIFO or tty can't wedge the loop
 * (a FIFO without a reader fails the write's open with ENXIO).
 * ---------------------------------------------------------------------------------------------
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/epoll.h>
#include <sys/inotify.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define PROTO_VERSION 4
#define MAX_REQ (8u << 20)
#define READ_CAP (4u << 20)
#define LIST_MAX (64u << 20)
#define PIPE_CHUNK 65536
/* Above this much unsent output we stop reading the child's pipes, so a slow client throttles
 * the command instead of growing our memory. */
#define OUT_HIGH (1u << 20)
/* After the exec'd shell exits, its pipes may still be held open by background children:
 * take what is already buffered, bounded so a chatty grandchild can't keep us here. */
#define EXIT_DRAIN_MAX (8u << 20)

/* Unsent stdin bytes a process may have queued before 'I' answers EAGAIN. */
#define STDIN_MAX (8u << 20)
/* Ended background processes nobody has attached to yet keep their exit status for a later
 * attach; the oldest is forgotten beyond this many. */
#define EXITED_KEEP 64
#define WATCH_MAX 4096

enum { W_LISTEN, W_SIGNAL, W_CONN, W_OUT, W_ERR, W_IN, W_INOTIFY };
enum { ST_HDR, ST_BODY, ST_EXEC, ST_WATCH, ST_CLOSING };

struct conn;
struct proc;
struct watch {
    int kind;
    struct conn *c;
    struct proc *p;
};

/* A command started by 'X'. It streams to the connection attached to it (the one that started
 * it, or one that attached later with 'A'); a background one outlives its connection. */
struct proc {
    pid_t pid; /* > 0 only while running and unreaped: the pid (and process group) can't be reused */
    pid_t spawned; /* the pid it was started with, kept after it ended */
    int pout, perr, pin, paused, timed_out, background, buffered, exited, status, dead;
    /* Timers, all served by the main loop's epoll timeout (no timerfd per command): the timeout
     * kill, the heartbeat, and when a buffered command's pipes start being watched. */
    int64_t deadline, last_send, watch_at, next_timer;
    struct conn *c;
    uint8_t *in;
    size_t in_len, in_off;
    int in_close;
    char *cmd, *cwd, *user;
    char *home; /* a trusted run's private HOME, removed when its shell exits */
    /* /tmp's mtime before the HOME was made and right after: put back once it is gone, unless
     * something else changed /tmp meanwhile (a trusted run leaves the sandbox's files as they were) */
    struct timespec tmp_mtime, tmp_mtime_made;
    struct watch w_out, w_err, w_in;
    struct proc *next, *prev, *next_dead;
};

struct conn {
    int fd, state, dead;
    int close_after; /* answer, then close: the request stream can't be trusted past a bad frame */
    uint32_t events;
    uint8_t hdr[4];
    uint32_t hdr_got;
    uint8_t *req;
    uint32_t req_len, req_got;
    uint8_t *out;
    size_t out_len, out_off, out_cap;
    int oom;
    struct watch w, w_ino;
    struct proc *p; /* ST_EXEC: the process whose output this connection receives */
    /* ST_WATCH: inotify fd and the directory (relative to the watched root) of each watch */
    int ifd, recursive, ino_paused;
    char *wroot;
    int nwd;
    struct { int wd; char *rel; } *wds;
    struct conn *next_dead;
};

static int ep = -1, lfd = -1, sfd = -1, devnull = -1, reserve_fd = -1;
/* What confinement was applied (reported by ping). */
#define CONF_LANDLOCK 1u
#define CONF_SECCOMP_LOG 2u
#define CONF_AUDIT_SESSION 4u
static int conf_landlock_abi;
static uint32_t conf_flags;
static int confine_deferred; /* --confine-on-claim, until the host's 'c' */
static void apply_confinement(void);
static void die(const char *what);
#define AGENT_LAST_WORDS "agent.exit"
static struct watch w_listen = {W_LISTEN, NULL, NULL}, w_signal = {W_SIGNAL, NULL, NULL};
static struct conn *graveyard;
static struct proc *procs, *proc_graveyard;
static int n_exited;
/* The host treats a long silence during an exec as a dead agent; tests shorten this. */
static int64_t heartbeat_ns = 5LL * 1000000000LL;
static struct rlimit child_nofile;
static int restore_nofile;
static int sock_dirfd = AT_FDCWD;
static const char *sock_base;
static dev_t sock_dev;
static ino_t sock_ino;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void be32(uint8_t *p, uint32_t v)
{
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static void be64(uint8_t *p, uint64_t v)
{
    be32(p, v >> 32);
    be32(p + 4, (uint32_t)v);
}

/* ------------------------------------------------------------------ output buffer / frames */

static int out_reserve(struct conn *c, size_t n)
{
    if (c->oom)
        return -1;
    /* Never moves existing bytes (only conn_flush compacts), so frame offsets stay valid
     * while a frame is being built. */
    if (c->out_len + n <= c->out_cap)
        return 0;
    size_t cap = c->out_cap ? c->out_cap : 4096;
    while (cap < c->out_len + n)
        cap *= 2;
    uint8_t *p = realloc(c->out, cap);
    if (!p) {
        c->oom = 1;
        return -1;
    }
    c->out = p;
    c->out_cap = cap;
    return 0;
}

static void put(struct conn *c, const void *p, size_t n)
{
    if (out_reserve(c, n) == 0) {
        if (n)
            memcpy(c->out + c->out_len, p, n);
        c->out_len += n;
    }
}

static void put_u8(struct conn *c, uint8_t v) { put(c, &v, 1); }
static void put_u32(struct conn *c, uint32_t v) { uint8_t b[4]; be32(b, v); put(c, b, 4); }
static void put_u64(struct conn *c, uint64_t v) { uint8_t b[8]; be64(b, v); put(c, b, 8); }
static void put_str(struct conn *c, const void *p, size_t n) { put_u32(c, (uint32_t)n); put(c, p, n); }

/* Frames are built in place; the returned offset is patched by frame_end. Offsets, not
 * pointers, because put() may move the buffer. */
static size_t frame_begin(struct conn *c, char type)
{
    if (out_reserve(c, 5) < 0)
        return 0;
    size_t start = c->out_len;
    c->out_len += 4;
    put_u8(c, (uint8_t)type);
    return start;
}

static void frame_end(struct conn *c, size_t start)
{
    if (!c->oom)
        be32(c->out + start, (uint32_t)(c->out_len - start - 4));
}

static void reply_err(struct conn *c, int err, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    size_t f = frame_begin(c, 'R');
    put_u32(c, (uint32_t)err);
    put_str(c, msg, (size_t)n);
    frame_end(c, f);
}

static void put_entry(struct conn *c, const char *name, size_t name_len, const struct stat *st)
{
    uint8_t kind = S_ISREG(st->st_mode) ? 1 : S_ISDIR(st->st_mode) ? 2 : S_ISLNK(st->st_mode) ? 3 : 0;
    put_str(c, name, name_len);
    put_u8(c, kind);
    put_u64(c, (uint64_t)st->st_size);
    put_u32(c, st->st_mode & 07777);
    put_u64(c, (uint64_t)((int64_t)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec));
}

/* ------------------------------------------------------------------ request reader */

struct rd {
    const uint8_t *p;
    size_t n;
    int bad, nul;
};

static int rd_need(struct rd *r, size_t n)
{
    if (r->bad || r->n < n) {
        r->bad = 1;
        return 0;
    }
    return 1;
}

static uint8_t rd_u8(struct rd *r)
{
    if (!rd_need(r, 1))
        return 0;
    uint8_t v = r->p[0];
    r->p++, r->n--;
    return v;
}

static uint32_t rd_u32(struct rd *r)
{
    if (!rd_need(r, 4))
        return 0;
    uint32_t v = (uint32_t)r->p[0] << 24 | (uint32_t)r->p[1] << 16 | (uint32_t)r->p[2] << 8 | r->p[3];
    r->p += 4, r->n -= 4;
    return v;
}

static uint64_t rd_u64(struct rd *r)
{
    uint64_t hi = rd_u32(r);
    return hi << 32 | rd_u32(r);
}

/* Returns a malloc'd NUL-terminated copy (never NULL unless out of memory or malformed). */
static char *rd_cstr(struct rd *r)
{
    uint32_t n = rd_u32(r);
    if (!rd_need(r, n))
        return NULL;
    if (memchr(r->p, 0, n))
        r->nul = 1;
    char *s = malloc((size_t)n + 1);
    if (!s) {
        r->bad = 1;
        return NULL;
    }
    memcpy(s, r->p, n);
    s[n] = 0;
    r->p += n, r->n -= n;
    return s;
}

/* Common validation after a request's fields are read; 0 if an error reply was queued. */
static int rd_done(struct conn *c, struct rd *r, int allow_rest)
{
    /* A client that sends malformed requests is not one of ours: answer it, then close. */
    if (r->bad || (!allow_rest && r->n)) {
        c->close_after = 1;
        reply_err(c, EPROTO, "malformed request");
        return 0;
    }
    if (r->nul) {
        c->close_after = 1;
        reply_err(c, EINVAL, "string argument contains a NUL byte");
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ connections */

static void ep_ctl(int op, int fd, struct watch *w, uint32_t ev)
{
    struct epoll_event e = {.events = ev, .data.ptr = w};
    epoll_ctl(ep, op, fd, &e);
}

static void conn_set_events(struct conn *c, uint32_t ev)
{
    if (c->fd >= 0 && ev != c->events) {
        ep_ctl(EPOLL_CTL_MOD, c->fd, &c->w, ev);
        c->events = ev;
    }
}

static void close_watched(int *fd)
{
    if (*fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
        close(*fd);
        *fd = -1;
    }
}

static void home_remove(struct proc *p);

static void proc_free(struct proc *p)
{
    home_remove(p);
    close_watched(&p->pout);
    close_watched(&p->perr);
    close_watched(&p->pin);
    p->next_timer = 0;
    if (p->prev)
        p->prev->next = p->next;
    else if (procs == p)
        procs = p->next;
    if (p->next)
        p->next->prev = p->prev;
    if (p->exited)
        n_exited--;
    p->next = p->prev = NULL;
    /* Freed after this round of events: a later event of the same epoll batch may name it. */
    p->dead = 1;
    p->next_dead = proc_graveyard;
    proc_graveyard = p;
}

static void proc_set_paused(struct proc *p, int paused)
{
    if (p->paused == paused)
        return;
    p->paused = paused;
    /* DEL rather than a zero event mask: EPOLLHUP is reported regardless of the mask and a
     * paused pipe whose writer is gone would spin the loop. */
    if (p->pout >= 0)
        ep_ctl(paused ? EPOLL_CTL_DEL : EPOLL_CTL_ADD, p->pout, &p->w_out, EPOLLIN);
    if (p->perr >= 0)
        ep_ctl(paused ? EPOLL_CTL_DEL : EPOLL_CTL_ADD, p->perr, &p->w_err, EPOLLIN);
}

static void timer_arm(struct proc *p);

/* The connection goes away: a foreground command dies with it (the client gave up on it; the
 * child stays unreaped until the SIGCHLD loop collects it, so its process group id can't have
 * been reused), a background one carries on with its output discarded until someone attaches. */
static void proc_detach(struct proc *p)
{
    p->c = NULL;
    proc_set_paused(p, 0);
    if (p->pid > 0 && !p->background)
        kill(-p->pid, SIGKILL);
    else if (p->pid > 0)
        timer_arm(p);
    if (p->pid <= 0 && !p->exited)
        proc_free(p);
}

static void watch_release(struct conn *c)
{
    close_watched(&c->ifd);
    for (int i = 0; i < c->nwd; i++)
        free(c->wds[i].rel);
    free(c->wds);
    c->wds = NULL;
    c->nwd = 0;
    free(c->wroot);
    c->wroot = NULL;
}

static void conn_close(struct conn *c)
{
    if (c->dead)
        return;
    if (c->p) {
        struct proc *p = c->p;
        c->p = NULL;
        proc_detach(p);
    }
    watch_release(c);
    close_watched(&c->fd);
    c->dead = 1;
    c->next_dead = graveyard;
    graveyard = c;
}

static void watch_set_paused(struct conn *c, int paused)
{
    if (c->ino_paused == paused || c->ifd < 0)
        return;
    c->ino_paused = paused;
    ep_ctl(paused ? EPOLL_CTL_DEL : EPOLL_CTL_ADD, c->ifd, &c->w_ino, EPOLLIN);
}

static void conn_flush(struct conn *c)
{
    if (c->oom) {
        conn_close(c);
        return;
    }
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->out_off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        conn_close(c);
        return;
    }
    size_t pending = c->out_len - c->out_off;
    if (!pending) {
        c->out_off = c->out_len = 0;
        if (c->state == ST_CLOSING) {
            conn_close(c);
            return;
        }
    } else if (c->out_off >= c->out_cap / 2) {
        memmove(c->out, c->out + c->out_off, pending);
        c->out_len = pending;
        c->out_off = 0;
    }
    /* The same mask in every state but closing: no epoll_ctl per request. */
    uint32_t ev = c->state != ST_CLOSING ? EPOLLIN | EPOLLRDHUP : 0;
    if (pending)
        ev |= EPOLLOUT;
    conn_set_events(c, ev);
    if (c->state == ST_EXEC && c->p) {
        if (pending > OUT_HIGH)
            proc_set_paused(c->p, 1);
        else if (pending <= OUT_HIGH / 2)
            proc_set_paused(c->p, 0);
    } else if (c->state == ST_WATCH) {
        if (pending > OUT_HIGH)
            watch_set_paused(c, 1);
        else if (pending <= OUT_HIGH / 2)
            watch_set_paused(c, 0);
    }
}

/* The request is answered: the connection waits for the next one (or closes, after a bad frame). */
static void finish(struct conn *c)
{
    free(c->req);
    c->req = NULL;
    if (c->close_after) {
        c->state = ST_CLOSING;
    } else {
        c->state = ST_HDR;
        c->hdr_got = 0;
    }
    conn_flush(c);
}

/* ------------------------------------------------------------------ exec */

static uint8_t discard_buf[PIPE_CHUNK];

/* One read from a child pipe: into the attached connection's output buffer as an 'O' frame, or
 * dropped when nobody is attached (a background process must not block on a full pipe).
 * Returns 1 on data, 0 when the pipe is finished (EOF/error, now closed), -1 if nothing to read. */
static int pipe_read(struct proc *p, int stream)
{
    int *fdp = stream == 1 ? &p->pout : &p->perr;
    struct conn *c = p->c;
    if (*fdp < 0)
        return 0;
    if (c && out_reserve(c, 6 + PIPE_CHUNK) < 0)
        return 0;
    for (;;) {
        uint8_t *h = c ? c->out + c->out_len : NULL;
        ssize_t n = read(*fdp, c ? h + 6 : discard_buf, PIPE_CHUNK);
        if (n > 0) {
            if (c) {
                be32(h, (uint32_t)n + 2);
                h[4] = 'O';
                h[5] = (uint8_t)stream;
                c->out_len += 6 + (size_t)n;
                if (!p->buffered)
                    p->last_send = now_ns();
            }
            return 1;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return -1;
        close_watched(fdp);
        return 0;
    }
}

static void on_pipe(struct proc *p, int stream)
{
    if (p->paused)
        return;
    pipe_read(p, stream);
    /* Buffered output waits for the exit, a heartbeat or OUT_HIGH bytes: one send per small command. */
    if (p->c && (!p->buffered || p->c->out_len - p->c->out_off > OUT_HIGH))
        conn_flush(p->c);
}

static void put_exit(struct conn *c, struct proc *p)
{
    int st = p->status;
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 255;
    size_t f = frame_begin(c, 'E');
    put_u32(c, (uint32_t)code);
    put_u8(c, (uint8_t)p->timed_out);
    put_u8(c, (uint8_t)(WIFSIGNALED(st) ? WTERMSIG(st) : 0));
    frame_end(c, f);
}

static void proc_exited(struct proc *p, int status)
{
    p->pid = 0;
    p->status = status;
    home_remove(p);
    for (int stream = 1; stream <= 2; stream++) {
        size_t got = 0;
        while (got < EXIT_DRAIN_MAX && pipe_read(p, stream) == 1)
            got += PIPE_CHUNK;
    }
    close_watched(&p->pout);
    close_watched(&p->perr);
    close_watched(&p->pin);
    p->next_timer = p->watch_at = 0;
    struct conn *c = p->c;
    if (c) {
        put_exit(c, p);
        c->p = NULL;
        proc_free(p);
        finish(c);
        return;
    }
    if (!p->background) {
        proc_free(p);
        return;
    }
    /* Nobody is listening: keep the status for a later attach, a bounded number of them. */
    p->exited = 1;
    if (++n_exited > EXITED_KEEP) {
        struct proc *oldest = NULL;
        for (struct proc *q = procs; q; q = q->next)
            if (q->exited)
                oldest = q; /* newest first in the list: the last one is the oldest */
        if (oldest)
            proc_free(oldest);
    }
}

static void timer_arm(struct proc *p)
{
    int64_t next = p->c ? p->last_send + heartbeat_ns : 0;
    if (p->deadline && !p->timed_out && (!next || p->deadline < next))
        next = p->deadline;
    if (p->watch_at && (!next || p->watch_at < next))
        next = p->watch_at;
    p->next_timer = p->pid > 0 ? next : 0; /* 0: none */
}

static void watch_pipes(struct proc *p)
{
    p->watch_at = 0;
    if (p->paused)
        return; /* proc_set_paused adds them when it resumes */
    if (p->pout >= 0)
        ep_ctl(EPOLL_CTL_ADD, p->pout, &p->w_out, EPOLLIN);
    if (p->perr >= 0)
        ep_ctl(EPOLL_CTL_ADD, p->perr, &p->w_err, EPOLLIN);
}

static void on_timer(struct proc *p, int64_t now)
{
    if (p->watch_at && now >= p->watch_at)
        watch_pipes(p);
    if (p->deadline && !p->timed_out && now >= p->deadline && p->pid > 0) {
        p->timed_out = 1;
        kill(-p->pid, SIGKILL);
    }
    struct conn *c = p->c;
    if (c && now - p->last_send >= heartbeat_ns) {
        size_t f = frame_begin(c, 'H');
        frame_end(c, f);
        p->last_send = now;
        conn_flush(c);
        if (c->dead)
            return; /* conn_close detached (and maybe freed) the process */
    }
    timer_arm(p);
}

static void stdin_flush(struct proc *p)
{
    while (p->pin >= 0 && p->in_off < p->in_len) {
        ssize_t n = write(p->pin, p->in + p->in_off, p->in_len - p->in_off);
        if (n > 0) {
            p->in_off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN) {
            ep_ctl(EPOLL_CTL_MOD, p->pin, &p->w_in, EPOLLOUT);
            return;
        }
        /* EPIPE: the process closed its stdin (or exited); what is left has no reader. */
        close_watched(&p->pin);
        break;
    }
    p->in_off = p->in_len = 0;
    if (p->pin >= 0) {
        if (p->in_close)
            close_watched(&p->pin);
        else
            ep_ctl(EPOLL_CTL_MOD, p->pin, &p->w_in, 0);
    }
}

static char *default_env[] = {
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    NULL,
};

/* A user of the sandbox's own /etc/passwd (and its groups from /etc/group). */
#define MAX_GROUPS 64
struct user {
    uid_t uid;
    gid_t gid;
    char name[256], home[PATH_MAX];
    gid_t groups[MAX_GROUPS];
    int ngroups;
};

/* Fields of a colon-separated line, in place; returns how many. */
static int split_colons(char *line, char **f, int max)
{
    int n = 0;
    f[n++] = line;
    for (char *q = line; *q && n < max; q++)
        if (*q == ':') {
            *q = 0;
            f[n++] = q + 1;
        }
    char *nl = strchr(f[n - 1], '\n');
    if (nl)
        *nl = 0;
    return n;
}

static int all_digits(const char *s)
{
    if (!*s)
        return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9')
            return 0;
    return 1;
}

/* 0 and *u filled, or -1: no such user. A numeric spec without a passwd entry is that uid with
 * the same gid and home "/". Not getpwnam: static glibc would want NSS modules. */
static int lookup_user(const char *spec, struct user *u)
{
    char line[4096];
    char *f[8];
    int found = 0;
    FILE *fp = fopen("/etc/passwd", "re");
    while (fp && fgets(line, sizeof line, fp)) {
        if (split_colons(line, f, 8) < 7)
            continue;
        if (strcmp(f[0], spec) && !(all_digits(spec) && !strcmp(f[2], spec)))
            continue;
        u->uid = (uid_t)strtoul(f[2], NULL, 10);
        u->gid = (gid_t)strtoul(f[3], NULL, 10);
        snprintf(u->name, sizeof u->name, "%s", f[0]);
        snprintf(u->home, sizeof u->home, "%s", *f[5] ? f[5] : "/");
        found = 1;
        break;
    }
    if (fp)
        fclose(fp);
    if (!found) {
        if (!all_digits(spec))
            return -1;
        u->uid = u->gid = (uid_t)strtoul(spec, NULL, 10);
        snprintf(u->name, sizeof u->name, "%s", spec);
        snprintf(u->home, sizeof u->home, "/");
    }
    u->groups[0] = u->gid;
    u->ngroups = 1;
    fp = fopen("/etc/group", "re");
    while (fp && fgets(line, sizeof line, fp) && u->ngroups < MAX_GROUPS) {
        if (split_colons(line, f, 8) < 4)
            continue;
        gid_t g = (gid_t)strtoul(f[2], NULL, 10);
        for (char *m = strtok(f[3], ","); m; m = strtok(NULL, ","))
            if (!strcmp(m, u->name) && g != u->gid) {
                u->groups[u->ngroups++] = g;
                break;
            }
    }
    if (fp)
        fclose(fp);
    return 0;
}

/* vfork: no page-table copy, so spawning costs the same however big we get. Not posix_spawn:
 * glibc's leaves its internal signals (32, 33) ignored in the child, and ignored dispositions
 * survive execve. */
static pid_t spawn_shell(char *cmd, const char *cwd, char **envp, int in_fd, int out_fd, int err_fd,
                         const struct user *u, int *err)
{
    /* The child runs on our memory until execve; its errno comes back through here. */
    volatile int child_err = 0;
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    sigset_t none;
    sigemptyset(&none);
    /* Opt every command into KSM (the host's reclaim service merges identical anonymous pages
     * across sandboxes): set once on our own mm, which an execve'd child inherits. A kernel
     * without it (EINVAL) merges nothing; that is all. */
    static int merge_asked;
    if (!merge_asked) {
        merge_asked = 1;
        prctl(67 /* PR_SET_MEMORY_MERGE */, 1, 0, 0, 0);
    }
    pid_t pid = vfork();
    if (pid == 0) {
        /* Only plain syscalls from here on. The fds are >= 3 (fds 0-2 are always open in the
         * agent), so dup2 really duplicates and clears close-on-exec. The user switch comes
         * before chdir, so the directory is entered with the user's own rights. */
        if (setsid() < 0 || dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0 ||
            (u && (setgroups((size_t)u->ngroups, u->groups) < 0 || setgid(u->gid) < 0 || setuid(u->uid) < 0)) ||
            (*cwd && chdir(cwd) < 0)) {
            child_err = errno;
            _exit(127);
        }
        if (restore_nofile)
            setrlimit(RLIMIT_NOFILE, &child_nofile);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execve("/bin/sh", argv, envp);
        child_err = errno ? errno : ENOEXEC;
        _exit(127);
    }
    if (pid < 0) {
        *err = errno;
        return -1;
    }
    if (child_err) {
        waitpid(pid, NULL, 0);
        *err = child_err;
        return -1;
    }
    return pid;
}

/* envp with HOME, USER and LOGNAME of user u (replacing any given); entries are borrowed. */
static char **user_env(char **envp, uint32_t nenv, const struct user *u, char *slots[3])
{
    char **out = calloc((size_t)nenv + 4, sizeof *out);
    if (!out)
        return NULL;
    size_t k = 0;
    for (uint32_t i = 0; i < nenv; i++)
        if (strncmp(envp[i], "HOME=", 5) && strncmp(envp[i], "USER=", 5) && strncmp(envp[i], "LOGNAME=", 8))
            out[k++] = envp[i];
    if (asprintf(&slots[0], "HOME=%s", u->home) < 0 || asprintf(&slots[1], "USER=%s", u->name) < 0 ||
        asprintf(&slots[2], "LOGNAME=%s", u->name) < 0) {
        free(out);
        return NULL;
    }
    out[k++] = slots[0];
    out[k++] = slots[1];
    out[k++] = slots[2];
    return out;
}

/* ------------------------------------------------------------------ trusted runs ('T') */

static const char *const trusted_path_dirs[] = {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"};
/* What a trusted run's programs, loader and interpreters are read from: each must be immutable for
 * the sandbox's processes. A read-only mount is what root in the sandbox can't undo (no
 * CAP_SYS_ADMIN, mount refused by seccomp); Landlock alone would not show in statvfs. */
static const char *const system_dirs[] = {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"};
static const char *const trusted_fixed[] = {
    "LANG=C.UTF-8",
    "PYTHONNOUSERSITE=1",        /* no ~/.local site-packages, so no usercustomize or .pth there */
    "PYTHONDONTWRITEBYTECODE=1", /* the grader leaves no __pycache__ in the workspace */
    "GIT_CONFIG_GLOBAL=/dev/null", /* not $HOME/.gitconfig nor $XDG_CONFIG_HOME/git/config */
    "GIT_CONFIG_NOSYSTEM=1",
};

/* The first system directory not on a read-only mount, or NULL. A missing one is fine: creating
 * it needs a writable "/", which the profile's Landlock rules refuse. */
static const char *writable_system_dir(void)
{
    for (size_t i = 0; i < sizeof system_dirs / sizeof *system_dirs; i++) {
        struct statvfs sv;
        if (statvfs(system_dirs[i], &sv) < 0) {
            if (errno == ENOENT)
                continue;
            return system_dirs[i];
        }
        if (!(sv.f_flag & ST_RDONLY))
            return system_dirs[i];
    }
    return NULL;
}

static int env_given(char **envp, uint32_t n, const char *kv)
{
    size_t klen = (size_t)(strchr(kv, '=') - kv) + 1;
    for (uint32_t i = 0; i < n; i++)
        if (!strncmp(envp[i], kv, klen))
            return 1;
    return 0;
}

static void env_free(char **env)
{
    for (size_t i = 0; env && env[i]; i++)
        free(env[i]);
    free(env);
}

/* A trusted run's whole environment (owned, NULL-terminated): the fixed set, each unless the
 * caller gave that variable, then the caller's. Nothing of ours or the sandbox's is inherited. */
static char **trusted_env(char **given, uint32_t ngiven, const char *home, const char *name)
{
    size_t nfixed = sizeof trusted_fixed / sizeof *trusted_fixed, k = 0;
    char **out = calloc((size_t)ngiven + nfixed + 5, sizeof *out);
    char path[512] = "PATH=", *mine[4] = {NULL, NULL, NULL, NULL};
    if (!out)
        return NULL;
    for (size_t i = 0; i < sizeof trusted_path_dirs / sizeof *trusted_path_dirs; i++) {
        struct stat st;
        if (stat(trusted_path_dirs[i], &st) == 0 && S_ISDIR(st.st_mode)) {
            if (path[5])
                strcat(path, ":");
            strcat(path, trusted_path_dirs[i]);
        }
    }
    if (asprintf(&mine[0], "HOME=%s", home) < 0 || asprintf(&mine[1], "USER=%s", name) < 0 ||
        asprintf(&mine[2], "LOGNAME=%s", name) < 0 || !(mine[3] = strdup(path)))
        goto fail;
    for (size_t i = 0; i < 4; i++) {
        if (env_given(given, ngiven, mine[i]))
            free(mine[i]);
        else
            out[k++] = mine[i];
        mine[i] = NULL;
    }
    for (size_t i = 0; i < nfixed; i++)
        if (!env_given(given, ngiven, trusted_fixed[i]) && !(out[k++] = strdup(trusted_fixed[i])))
            goto fail;
    for (uint32_t i = 0; i < ngiven; i++)
        if (!(out[k++] = strdup(given[i])))
            goto fail;
    return out;
fail:
    for (size_t i = 0; i < 4; i++)
        free(mine[i]);
    env_free(out);
    return NULL;
}

static void rm_tree(const char *path);

/* The fresh private HOME of a trusted run, owned by the user it runs as; NULL and errno set.
 * times[0], times[1]: /tmp's mtime before and after. */
static char *home_create(const struct user *u, struct timespec times[2])
{
    char tmpl[] = "/tmp/.dsec-trusted-XXXXXX";
    struct stat st;
    times[0] = times[1] = (struct timespec){0, 0};
    if (stat("/tmp", &st) == 0)
        times[0] = st.st_mtim;
    if (!mkdtemp(tmpl)) /* 0700, whatever the umask */
        return NULL;
    if (stat("/tmp", &st) == 0)
        times[1] = st.st_mtim;
    char *home = strdup(tmpl);
    if (!home || (u && chown(tmpl, u->uid, u->gid) < 0)) {
        int e = home ? errno : ENOMEM;
        rmdir(tmpl);
        free(home);
        errno = e;
        return NULL;
    }
    return home;
}

static void home_remove(struct proc *p)
{
    if (!p->home)
        return;
    struct stat st;
    int untouched = p->tmp_mtime.tv_sec && stat("/tmp", &st) == 0 && st.st_mtim.tv_sec == p->tmp_mtime_made.tv_sec &&
                    st.st_mtim.tv_nsec == p->tmp_mtime_made.tv_nsec;
    rm_tree(p->home);
    if (untouched) {
        struct timespec ts[2] = {{0, UTIME_OMIT}, p->tmp_mtime};
        utimensat(AT_FDCWD, "/tmp", ts, 0);
    }
    free(p->home);
    p->home = NULL;
}


/* ``now``: send the 'i' frame at once (a background start waits for its pid); a buffered one goes
 * out with the output, a heartbeat or the exit, one wake-up of the host fewer per command. */
static void proc_attach(struct proc *p, struct conn *c, int now)
{
    p->c = c;
    c->p = p;
    c->state = ST_EXEC;
    p->last_send = now_ns();
    size_t f = frame_begin(c, 'i');
    put_u32(c, (uint32_t)p->pid);
    frame_end(c, f);
    timer_arm(p);
    free(c->req);
    c->req = NULL;
    if (now)
        conn_flush(c);
}

#define X_BACKGROUND 1u
#define X_STDIN 2u
#define X_BUFFERED 4u
#define WATCH_DELAY_NS (2 * 1000000LL)

static void op_exec(struct conn *c, struct rd *r, int trusted)
{
    char *cmd = NULL, *cwd = NULL, *user = NULL, **envp = NULL, **uenv = NULL, *slots[3] = {NULL, NULL, NULL};
    char *home = NULL, **tenv = NULL;
    struct timespec tmp_times[2] = {{0, 0}, {0, 0}};
    uint32_t nenv = 0, i;
    int po[2] = {-1, -1}, pe[2] = {-1, -1}, pi[2] = {-1, -1};
    struct user u;
    struct proc *p = NULL;

    uint32_t timeout_ms = rd_u32(r);
    cmd = rd_cstr(r);
    cwd = rd_cstr(r);
    nenv = rd_u32(r);
    if (nenv > r->n / 4)
        r->bad = 1;
    if (!r->bad) {
        envp = calloc((size_t)nenv + 1, sizeof *envp);
        if (!envp)
            r->bad = 1;
        for (i = 0; i < nenv && !r->bad; i++)
            envp[i] = rd_cstr(r);
    }
    uint8_t flags = rd_u8(r);
    user = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;

    if (*user) {
        if (lookup_user(user, &u) < 0) {
            reply_err(c, ESRCH, "unknown user %s: not in the sandbox's /etc/passwd", user);
            goto out;
        }
    }
    if (trusted) {
        const char *w = writable_system_dir();
        if (w) {
            reply_err(c, ENOTSUP, "trusted run refused: %s is writable in this sandbox (its profile leaves system "
                      "directories writable, and no environment keeps a run from what was written there)", w);
            goto out;
        }
        if (!(home = home_create(*user ? &u : NULL, tmp_times))) {
            reply_err(c, ENOTSUP, "trusted run refused: cannot create a private HOME under /tmp: %s", strerror(errno));
            goto out;
        }
        if (!*cwd) {
            free(cwd);
            cwd = strdup(home);
        }
        if (!(tenv = trusted_env(envp, nenv, home, *user ? u.name : "root")) || !cwd) {
            reply_err(c, ENOMEM, "out of memory");
            goto out;
        }
    } else if (*user) {
        if (!*cwd) {
            struct stat st;
            if (stat(u.home, &st) == 0 && S_ISDIR(st.st_mode)) {
                free(cwd);
                cwd = strdup(u.home);
            }
        }
        uenv = user_env(nenv ? envp : default_env, nenv ? nenv : 2, &u, slots);
        if (!uenv || !cwd) {
            reply_err(c, ENOMEM, "out of memory");
            goto out;
        }
    }
    if (*cwd) {
        struct stat st;
        if (stat(cwd, &st) < 0) {
            reply_err(c, errno, "cwd %s: %s", cwd, strerror(errno));
            goto out;
        }
        if (!S_ISDIR(st.st_mode)) {
            reply_err(c, ENOTDIR, "cwd %s: %s", cwd, strerror(ENOTDIR));
            goto out;
        }
    }
    p = calloc(1, sizeof *p);
    if (!p || pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0 ||
        ((flags & X_STDIN) && pipe2(pi, O_CLOEXEC) < 0)) {
        reply_err(c, errno ? errno : ENOMEM, "exec setup: %s", strerror(errno ? errno : ENOMEM));
        goto out;
    }
    /* Only our ends are non-blocking: the child must see ordinary blocking stdio. */
    fcntl(po[0], F_SETFL, O_NONBLOCK);
    fcntl(pe[0], F_SETFL, O_NONBLOCK);
    if (pi[1] >= 0)
        fcntl(pi[1], F_SETFL, O_NONBLOCK);

    int err = 0;
    pid_t pid = spawn_shell(cmd, cwd, tenv ? tenv : uenv ? uenv : nenv ? envp : default_env, pi[0] >= 0 ? pi[0] : devnull,
                            po[1], pe[1], *user ? &u : NULL, &err);
    close(po[1]);
    close(pe[1]);
    po[1] = pe[1] = -1;
    if (pi[0] >= 0) {
        close(pi[0]);
        pi[0] = -1;
    }
    if (pid < 0) {
        if (*user && (err == EPERM || err == EINVAL))
            reply_err(c, err, "cannot switch to user %s: %s", user, strerror(err));
        else
            reply_err(c, err, "spawn /bin/sh: %s", strerror(err));
        goto out;
    }

    p->pid = p->spawned = pid;
    p->pout = po[0];
    p->perr = pe[0];
    p->pin = pi[1];
    p->background = (flags & X_BACKGROUND) != 0;
    p->buffered = (flags & X_BUFFERED) && !p->background;
    p->cmd = cmd;
    p->cwd = cwd;
    p->user = user;
    p->home = home;
    p->tmp_mtime = tmp_times[0];
    p->tmp_mtime_made = tmp_times[1];
    cmd = cwd = user = home = NULL;
    po[0] = pe[0] = pi[1] = -1;
    p->w_out = (struct watch){W_OUT, NULL, p};
    p->w_err = (struct watch){W_ERR, NULL, p};
    p->w_in = (struct watch){W_IN, NULL, p};
    p->deadline = timeout_ms ? now_ns() + (int64_t)timeout_ms * 1000000LL : 0;
    /* A buffered command's pipes are watched only from WATCH_DELAY on: one that ends sooner (most
     * do) has its output taken at its exit, without a wake-up for it; one that fills a pipe first
     * waits at most that long. */
    if (p->buffered)
        p->watch_at = now_ns() + WATCH_DELAY_NS;
    else
        watch_pipes(p);
    if (p->pin >= 0)
        ep_ctl(EPOLL_CTL_ADD, p->pin, &p->w_in, 0);
    p->next = procs;
    if (procs)
        procs->prev = p;
    procs = p;
    p = NULL;
    proc_attach(procs, c, !procs->buffered);

out:
    for (i = 0; envp && i < nenv; i++)
        free(envp[i]);
    free(envp);
    free(uenv);
    env_free(tenv);
    if (home) {
        rm_tree(home);
        free(home);
    }
    for (i = 0; i < 3; i++)
        free(slots[i]);
    free(cmd);
    free(cwd);
    free(user);
    free(p);
    for (i = 0; i < 2; i++) {
        if (po[i] >= 0) close(po[i]);
        if (pe[i] >= 0) close(pe[i]);
        if (pi[i] >= 0) close(pi[i]);
    }
    if (c->state != ST_EXEC)
        finish(c);
}

/* Processes are looked up by the pid they were started with, running or (kept) ended. */
static struct proc *proc_by_pid(uint32_t pid, int running_only)
{
    for (struct proc *p = procs; p; p = p->next) {
        if ((uint32_t)p->spawned == pid && (!running_only || p->pid > 0))
            return p;
    }
    return NULL;
}

static void op_attach(struct conn *c, struct rd *r)
{
    uint32_t pid = rd_u32(r);
    if (!rd_done(c, r, 0))
        goto done;
    struct proc *p = proc_by_pid(pid, 0);
    if (!p) {
        reply_err(c, ESRCH, "no process %u", pid);
        goto done;
    }
    if (p->c) {
        reply_err(c, EBUSY, "process %u is attached to another connection", pid);
        goto done;
    }
    if (p->exited) {
        size_t f = frame_begin(c, 'i');
        put_u32(c, pid);
        frame_end(c, f);
        put_exit(c, p);
        proc_free(p);
        goto done;
    }
    proc_attach(p, c, 1);
    return;
done:
    finish(c);
}

static void op_stdin(struct conn *c, struct rd *r)
{
    uint32_t pid = rd_u32(r);
    uint8_t flags = rd_u8(r);
    if (!rd_done(c, r, 1))
        return;
    struct proc *p = proc_by_pid(pid, 1);
    if (!p) {
        reply_err(c, ESRCH, "no running process %u", pid);
        return;
    }
    if (p->pin < 0 || p->in_close) {
        reply_err(c, EPIPE, "process %u has no open stdin", pid);
        return;
    }
    if (r->n) {
        if (p->in_len - p->in_off + r->n > STDIN_MAX) {
            reply_err(c, EAGAIN, "process %u is not reading its stdin (%u bytes queued)", pid, (unsigned)(p->in_len - p->in_off));
            return;
        }
        if (p->in_off) {
            memmove(p->in, p->in + p->in_off, p->in_len - p->in_off);
            p->in_len -= p->in_off;
            p->in_off = 0;
        }
        uint8_t *b = realloc(p->in, p->in_len + r->n);
        if (!b) {
            reply_err(c, ENOMEM, "out of memory");
            return;
        }
        p->in = b;
        memcpy(p->in + p->in_len, r->p, r->n);
        p->in_len += r->n;
    }
    if (flags & 1)
        p->in_close = 1;
    stdin_flush(p);
    if (p->pin < 0 && r->n && !(flags & 1)) {
        reply_err(c, EPIPE, "process %u closed its stdin", pid);
        return;
    }
    size_t f = frame_begin(c, 'K');
    frame_end(c, f);
}

static void op_signal(struct conn *c, struct rd *r)
{
    uint32_t pid = rd_u32(r);
    uint32_t sig = rd_u32(r);
    if (!rd_done(c, r, 0))
        return;
    struct proc *p = proc_by_pid(pid, 1);
    if (!p) {
        reply_err(c, ESRCH, "no running process %u", pid);
        return;
    }
    /* The whole process group (the command ran in its own session): the shell and what it
     * started. Only processes we started: a pid of anything else is not found above. */
    if (kill(-p->pid, (int)sig) < 0) {
        reply_err(c, errno, "kill %u: %s", pid, strerror(errno));
        return;
    }
    size_t f = frame_begin(c, 'K');
    frame_end(c, f);
}

static void op_procs(struct conn *c, struct rd *r)
{
    if (!rd_done(c, r, 0))
        return;
    size_t f = frame_begin(c, 'j');
    size_t count_at = c->out_len;
    put_u32(c, 0);
    uint32_t n = 0;
    for (struct proc *p = procs; p; p = p->next) {
        if (p->pid <= 0)
            continue;
        put_u32(c, (uint32_t)p->pid);
        put_u8(c, (uint8_t)((p->background ? 1 : 0) | (p->pin >= 0 && !p->in_close ? 2 : 0) | (p->c ? 4 : 0)));
        put_str(c, p->cmd, strlen(p->cmd));
        put_str(c, p->cwd, strlen(p->cwd));
        put_str(c, p->user, strlen(p->user));
        n++;
    }
    if (!c->oom)
        be32(c->out + count_at, n);
    frame_end(c, f);
}

/* ------------------------------------------------------------------ file operations */

static int mkdir_parents(const char *path)
{
    char *buf = strdup(path);
    if (!buf)
        return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(buf, 0755) < 0 && errno != EEXIST) {
            int e = errno;
            free(buf);
            errno = e;
            return -1;
        }
        *p = '/';
    }
    free(buf);
    return 0;
}

#define META_PREFIX "user.e2b."
#define META_MAX 64 /* metadata pairs of one write */
#define XATTR_LIST_MAX_LEN 65536

/* Remove every user.e2b.* xattr of the open file, then set the given ones (keys without prefix). */
static int meta_replace(int fd, char **kv, uint32_t n)
{
    char names[XATTR_LIST_MAX_LEN];
    ssize_t len = flistxattr(fd, names, sizeof names);
    if (len < 0 && errno != ENOTSUP)
        return -1;
    for (ssize_t i = 0; i < len; i += (ssize_t)strlen(names + i) + 1)
        if (!strncmp(names + i, META_PREFIX, sizeof META_PREFIX - 1) && fremovexattr(fd, names + i) < 0 && errno != ENODATA)
            return -1;
    for (uint32_t i = 0; i < n; i++) {
        char name[XATTR_NAME_MAX + 1];
        if ((size_t)snprintf(name, sizeof name, "%s%s", META_PREFIX, kv[2 * i]) >= sizeof name) {
            errno = ERANGE;
            return -1;
        }
        if (fsetxattr(fd, name, kv[2 * i + 1], strlen(kv[2 * i + 1]), 0) < 0)
            return -1;
    }
    return 0;
}

static void write_file(struct conn *c, struct rd *r, int with_attrs);

static void op_write(struct conn *c, struct rd *r) { write_file(c, r, 0); }
static void op_write_attrs(struct conn *c, struct rd *r) { write_file(c, r, 1); }

static void write_file(struct conn *c, struct rd *r, int with_attrs)
{
    uint64_t off = rd_u64(r);
    uint8_t flags = rd_u8(r);
    uint32_t mode = rd_u32(r) & 07777;
    uint32_t uid = 0, gid = 0, nmeta = 0;
    char **kv = NULL;
    char *path = NULL;
    if (with_attrs) {
        uid = rd_u32(r);
        gid = rd_u32(r);
        nmeta = rd_u32(r);
        if (nmeta > META_MAX)
            r->bad = 1;
        else if (nmeta && !(kv = calloc(2 * (size_t)nmeta, sizeof *kv)))
            r->bad = 1;
        for (uint32_t i = 0; i < 2 * nmeta && !r->bad; i++)
            kv[i] = rd_cstr(r);
    } else {
        flags &= 1;
    }
    path = rd_cstr(r);
    if (!rd_done(c, r, 1))
        goto out;
    for (uint32_t i = 0; i < nmeta; i++) /* refused before anything is created */
        if (sizeof META_PREFIX - 1 + strlen(kv[2 * i]) > XATTR_NAME_MAX || !*kv[2 * i] || strlen(kv[2 * i + 1]) > XATTR_SIZE_MAX) {
            reply_err(c, ERANGE, "metadata key or value of %s too long (or an empty key)", path);
            goto out;
        }
    if (!*path || off > (uint64_t)INT64_MAX) {
        reply_err(c, EINVAL, "invalid path or offset");
        goto out;
    }
    int created = 1;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, mode);
    if (fd < 0 && errno == ENOENT && mkdir_parents(path) == 0)
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, mode);
    if (fd < 0 && errno == EEXIST) {
        created = 0;
        /* O_NONBLOCK: opening a FIFO for writing would otherwise block until a reader appears. */
        fd = open(path, O_WRONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    }
    if (fd < 0) {
        reply_err(c, errno, "open %s: %s", path, strerror(errno));
        goto out;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        reply_err(c, EINVAL, "%s: not a regular file", path);
        close(fd);
        goto out;
    }
    if (created)
        fchmod(fd, mode);
    if ((flags & 2) && fchown(fd, (uid_t)uid, (gid_t)gid) < 0) {
        reply_err(c, errno, "chown %s: %s", path, strerror(errno));
        close(fd);
        goto out;
    }
    if ((flags & 4) && meta_replace(fd, kv, nmeta) < 0) {
        reply_err(c, errno, "set metadata of %s: %s", path, strerror(errno));
        close(fd);
        goto out;
    }
    if (!created && (flags & 1) && ftruncate(fd, 0) < 0) {
        reply_err(c, errno, "truncate %s: %s", path, strerror(errno));
        close(fd);
        goto out;
    }
    const uint8_t *p = r->p;
    size_t left = r->n;
    while (left) {
        ssize_t n = pwrite(fd, p, left, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            reply_err(c, n < 0 ? errno : EIO, "write %s: %s", path, strerror(n < 0 ? errno : EIO));
            close(fd);
            goto out;
        }
        p += n, left -= (size_t)n, off += (uint64_t)n;
    }
    if (fstat(fd, &st) < 0)
        st.st_size = 0;
    if (close(fd) < 0) {
        reply_err(c, errno, "close %s: %s", path, strerror(errno));
        goto out;
    }
    size_t f = frame_begin(c, 'Z');
    put_u64(c, (uint64_t)st.st_size);
    frame_end(c, f);
out:
    for (uint32_t i = 0; kv && i < 2 * nmeta; i++)
        free(kv[i]);
    free(kv);
    free(path);
}

/* The tail of an xentry: owner, symlink target, user.e2b.* xattrs of `path` (not followed). */
static void put_entry_extra(struct conn *c, const char *path, const struct stat *st)
{
    put_u32(c, (uint32_t)st->st_uid);
    put_u32(c, (uint32_t)st->st_gid);
    char target[PATH_MAX];
    ssize_t tn = S_ISLNK(st->st_mode) ? readlink(path, target, sizeof target) : -1;
    put_str(c, target, tn > 0 ? (size_t)tn : 0);
    char names[XATTR_LIST_MAX_LEN];
    ssize_t len = S_ISLNK(st->st_mode) ? -1 : llistxattr(path, names, sizeof names); /* user.* is never on a symlink */
    size_t count_at = c->out_len;
    uint32_t count = 0;
    put_u32(c, 0);
    for (ssize_t i = 0; i < len; i += (ssize_t)strlen(names + i) + 1) {
        if (strncmp(names + i, META_PREFIX, sizeof META_PREFIX - 1))
            continue;
        char value[4096];
        ssize_t vn = lgetxattr(path, names + i, value, sizeof value);
        if (vn < 0)
            continue; /* removed meanwhile, or too long to be ours */
        const char *key = names + i + sizeof META_PREFIX - 1;
        put_str(c, key, strlen(key));
        put_str(c, value, (size_t)vn);
        count++;
    }
    if (!c->oom)
        be32(c->out + count_at, count);
}

/* One directory listing: 'T' entries, or with `extra` 't' entries that also carry put_entry_extra's fields. */
static void list_dir(struct conn *c, struct rd *r, int extra)
{
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = dfd < 0 ? NULL : fdopendir(dfd);
    if (!d) {
        reply_err(c, errno, "opendir %s: %s", path, strerror(errno));
        if (dfd >= 0)
            close(dfd);
        goto out;
    }
    size_t f = frame_begin(c, extra ? 't' : 'T');
    size_t count_at = c->out_len;
    put_u32(c, 0);
    uint32_t count = 0;
    struct dirent *de;
    char full[PATH_MAX];
    for (;;) {
        errno = 0;
        de = readdir(d);
        if (!de)
            break;
        if (de->d_name[0] == '.' && (!de->d_name[1] || (de->d_name[1] == '.' && !de->d_name[2])))
            continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue; /* removed while we were listing */
        if (extra && (size_t)snprintf(full, sizeof full, "%s/%s", path, de->d_name) >= sizeof full)
            continue;
        put_entry(c, de->d_name, strlen(de->d_name), &st);
        if (extra)
            put_entry_extra(c, full, &st);
        count++;
        if (c->out_len - f > LIST_MAX) {
            errno = EFBIG;
            break;
        }
    }
    int e = errno;
    closedir(d);
    if (e) {
        c->out_len = f;
        reply_err(c, e, "readdir %s: %s", path, strerror(e));
        goto out;
    }
    if (!c->oom)
        be32(c->out + count_at, count);
    frame_end(c, f);
out:
    free(path);
}

static void op_list_long(struct conn *c, struct rd *r)
{
    list_dir(c, r, 1);
}

/* One stat: an 'N' entry, or with `extra` an 'n' entry that also carries put_entry_extra's fields. */
static void stat_path(struct conn *c, struct rd *r, int extra)
{
    uint8_t follow = rd_u8(r);
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    struct stat st;
    if ((follow ? stat(path, &st) : lstat(path, &st)) < 0) {
        reply_err(c, errno, "stat %s: %s", path, strerror(errno));
        goto out;
    }
    size_t f = frame_begin(c, extra ? 'n' : 'N');
    put_entry(c, "", 0, &st);
    if (extra) {
        char real[PATH_MAX];
        /* Followed: the extras are the target's (a symlink's own xattrs and target are not asked for). */
        put_entry_extra(c, follow && realpath(path, real) ? real : path, &st);
    }
    frame_end(c, f);
out:
    free(path);
}

static void op_stat_long(struct conn *c, struct rd *r)
{
    stat_path(c, r, 1);
}

static void op_read(struct conn *c, struct rd *r)
{
    uint64_t off = rd_u64(r);
    uint64_t len = rd_u64(r);
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    if (off > (uint64_t)INT64_MAX) {
        reply_err(c, EINVAL, "invalid offset");
        goto out;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        reply_err(c, errno, "open %s: %s", path, strerror(errno));
        goto out;
    }
    struct stat st = {0};
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        int e = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        reply_err(c, e, "%s: %s", path, e == EISDIR ? strerror(EISDIR) : "not a regular file");
        close(fd);
        goto out;
    }
    size_t want = len > READ_CAP ? READ_CAP : (size_t)len;
    size_t f = frame_begin(c, 'D');
    put_u64(c, (uint64_t)st.st_size);
    if (out_reserve(c, want) < 0) {
        close(fd);
        goto out;
    }
    size_t got = 0;
    while (got < want) {
        ssize_t n = pread(fd, c->out + c->out_len + got, want - got, (off_t)(off + got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            int e = errno;
            c->out_len = f;
            reply_err(c, e, "read %s: %s", path, strerror(e));
            close(fd);
            goto out;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    c->out_len += got;
    frame_end(c, f);
    close(fd);
out:
    free(path);
}

static void op_list(struct conn *c, struct rd *r)
{
    list_dir(c, r, 0);
}

static int rm_errno;
static char rm_path[PATH_MAX];

static int rm_one(const char *p, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    int rc = (type == FTW_DP || type == FTW_DNR) ? rmdir(p) : unlink(p);
    if (rc < 0 && errno != ENOENT) {
        rm_errno = errno;
        snprintf(rm_path, sizeof rm_path, "%s", p);
        return 1;
    }
    return 0;
}

/* Best effort (a trusted run's HOME): symlinks are removed, never followed; other mounts untouched. */
static void rm_tree(const char *path)
{
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
}

static void op_remove(struct conn *c, struct rd *r)
{
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    struct stat st;
    if (lstat(path, &st) < 0) {
        reply_err(c, errno, "remove %s: %s", path, strerror(errno));
        goto out;
    }
    if (S_ISDIR(st.st_mode)) {
        rm_errno = 0;
        int rc = nftw(path, rm_one, 32, FTW_DEPTH | FTW_PHYS);
        if (rc != 0) {
            int e = rm_errno ? rm_errno : errno;
            reply_err(c, e, "remove %s: %s", rm_errno ? rm_path : path, strerror(e));
            goto out;
        }
    } else if (unlink(path) < 0) {
        reply_err(c, errno, "remove %s: %s", path, strerror(errno));
        goto out;
    }
    size_t f = frame_begin(c, 'K');
    frame_end(c, f);
out:
    free(path);
}

static void op_exists(struct conn *c, struct rd *r)
{
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    struct stat st;
    int yes = lstat(path, &st) == 0;
    if (!yes && errno != ENOENT && errno != ENOTDIR) {
        reply_err(c, errno, "lstat %s: %s", path, strerror(errno));
        goto out;
    }
    size_t f = frame_begin(c, 'B');
    put_u8(c, (uint8_t)yes);
    frame_end(c, f);
out:
    free(path);
}

static void op_stat(struct conn *c, struct rd *r)
{
    stat_path(c, r, 0);
}

static void op_mkdir(struct conn *c, struct rd *r)
{
    uint32_t mode = rd_u32(r) & 07777;
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    if (!*path) {
        reply_err(c, EINVAL, "empty path");
        goto out;
    }
    struct stat st;
    int created = 0;
    if (lstat(path, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) {
            reply_err(c, EEXIST, "mkdir %s: exists and is not a directory", path);
            goto out;
        }
    } else if (errno != ENOENT || ((mkdir_parents(path) < 0 || mkdir(path, mode) < 0) && errno != EEXIST)) {
        reply_err(c, errno, "mkdir %s: %s", path, strerror(errno));
        goto out;
    } else {
        created = 1;
        chmod(path, mode); /* umask-free, like a written file's mode */
    }
    size_t f = frame_begin(c, 'B');
    put_u8(c, (uint8_t)created);
    frame_end(c, f);
out:
    free(path);
}

static void op_rename(struct conn *c, struct rd *r)
{
    char *from = rd_cstr(r);
    char *to = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto out;
    struct stat st;
    if (lstat(from, &st) < 0) {
        reply_err(c, errno, "rename %s: %s", from, strerror(errno));
        goto out;
    }
    int rc = rename(from, to);
    if (rc < 0 && errno == ENOENT && mkdir_parents(to) == 0)
        rc = rename(from, to);
    if (rc < 0) {
        reply_err(c, errno, "rename %s -> %s: %s", from, to, strerror(errno));
        goto out;
    }
    size_t f = frame_begin(c, 'K');
    frame_end(c, f);
out:
    free(from);
    free(to);
}

#define WATCH_MASK (IN_CREATE | IN_DELETE | IN_MODIFY | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF)

static int watch_add(struct conn *c, const char *abs, const char *rel)
{
    if (c->nwd >= WATCH_MAX) {
        errno = ENOSPC;
        return -1;
    }
    int wd = inotify_add_watch(c->ifd, abs, WATCH_MASK | IN_ONLYDIR | IN_DONT_FOLLOW);
    if (wd < 0)
        return -1;
    for (int i = 0; i < c->nwd; i++)
        if (c->wds[i].wd == wd)
            return 0;
    void *m = realloc(c->wds, (size_t)(c->nwd + 1) * sizeof *c->wds);
    char *dup = strdup(rel);
    if (!m || !dup) {
        if (m)
            c->wds = m;
        free(dup);
        errno = ENOMEM;
        return -1;
    }
    c->wds = m;
    c->wds[c->nwd].wd = wd;
    c->wds[c->nwd].rel = dup;
    c->nwd++;
    return 0;
}

/* nftw has no context argument. */
static struct conn *walk_conn;
static size_t walk_root_len;

static int watch_walk_one(const char *p, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if (type == FTW_D && strlen(p) > walk_root_len)
        watch_add(walk_conn, p, p + walk_root_len + 1); /* best effort: a subdir may vanish meanwhile */
    return walk_conn->nwd >= WATCH_MAX;
}

static void watch_tree(struct conn *c, const char *abs)
{
    walk_conn = c;
    walk_root_len = strlen(c->wroot);
    nftw(abs, watch_walk_one, 16, FTW_PHYS);
}

static void op_watch(struct conn *c, struct rd *r)
{
    uint8_t recursive = rd_u8(r);
    char *path = rd_cstr(r);
    if (!rd_done(c, r, 0))
        goto fail;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        path[--n] = 0;
    struct stat st;
    if (stat(path, &st) < 0) {
        reply_err(c, errno, "watch %s: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISDIR(st.st_mode)) {
        reply_err(c, ENOTDIR, "watch %s: %s", path, strerror(ENOTDIR));
        goto fail;
    }
    c->ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (c->ifd < 0 || watch_add(c, path, "") < 0) {
        reply_err(c, errno, "watch %s: %s", path, strerror(errno));
        goto fail;
    }
    c->wroot = path;
    c->recursive = recursive;
    if (recursive)
        watch_tree(c, path);
    c->w_ino = (struct watch){W_INOTIFY, c, NULL};
    ep_ctl(EPOLL_CTL_ADD, c->ifd, &c->w_ino, EPOLLIN);
    c->state = ST_WATCH;
    size_t f = frame_begin(c, 'w');
    frame_end(c, f);
    free(c->req);
    c->req = NULL;
    conn_flush(c);
    return;
fail:
    free(path);
    finish(c);
}

static void on_inotify(struct conn *c)
{
    char buf[16384] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        ssize_t n = read(c->ifd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        for (char *q = buf; q < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)q;
            q += sizeof *ev + ev->len;
            const char *rel = NULL;
            int idx = -1;
            for (int i = 0; i < c->nwd; i++)
                if (c->wds[i].wd == ev->wd) {
                    rel = c->wds[i].rel;
                    idx = i;
                    break;
                }
            if (ev->mask & IN_IGNORED) {
                if (idx >= 0) {
                    free(c->wds[idx].rel);
                    c->wds[idx] = c->wds[--c->nwd];
                }
                continue;
            }
            if (!rel && !(ev->mask & IN_Q_OVERFLOW))
                continue;
            char name[PATH_MAX];
            const char *leaf = ev->len ? ev->name : "";
            snprintf(name, sizeof name, "%s%s%s", rel ? rel : "", rel && *rel && *leaf ? "/" : "", leaf);
            if (c->recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO))) {
                char abs[PATH_MAX];
                if ((size_t)snprintf(abs, sizeof abs, "%s/%s", c->wroot, name) < sizeof abs && watch_add(c, abs, name) == 0)
                    watch_tree(c, abs); /* what was made inside before the watch existed */
            }
            size_t f = frame_begin(c, 'F');
            put_u32(c, ev->mask);
            put_str(c, name, strlen(name));
            frame_end(c, f);
        }
    }
    conn_flush(c);
}

static void op_ping(struct conn *c, struct rd *r)
{
    if (!rd_done(c, r, 0))
        return;
    size_t f = frame_begin(c, 'K');
    put_u32(c, PROTO_VERSION);
    put_u32(c, (uint32_t)conf_landlock_abi);
    put_u32(c, conf_flags);
    frame_end(c, f);
}

/* Threads of this process (Landlock and seccomp restrict only the calling thread; -1: unknown). */
static int thread_count(void)
{
    FILE *f = fopen("/proc/self/status", "re");
    int n = -1;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    if (f)
        fclose(f);
    return n;
}

static void op_confine(struct conn *c, struct rd *r)
{
    if (!rd_done(c, r, 0))
        return;
    if (confine_deferred) {
        /* What we restrict now is all there is: this one thread, and no child (nothing ran). */
        if (procs || thread_count() != 1) {
            errno = EBUSY;
            die("confine: the agent has another thread or a child");
        }
        apply_confinement(); /* exits on failure: the host removes the container */
        confine_deferred = 0;
    }
    op_ping(c, r);
}

static void dispatch(struct conn *c)
{
    struct rd r = {c->req + 1, c->req_len - 1, 0, 0};
    if (confine_deferred && c->req[0] != 'P' && c->req[0] != 'c') {
        reply_err(c, EACCES, "not confined yet: a warm container serves only after its claim");
        finish(c);
        return;
    }
    switch (c->req[0]) {
    case 'c': op_confine(c, &r); break;
    case 'X': op_exec(c, &r, 0); return; /* finishes itself: it may keep the connection */
    case 'T': op_exec(c, &r, 1); return;
    case 'P': op_ping(c, &r); break;
    case 'W': op_write(c, &r); break;
    case 'G': op_read(c, &r); break;
    case 'L': op_list(c, &r); break;
    case 'M': op_remove(c, &r); break;
    case 'Q': op_exists(c, &r); break;
    case 'S': op_stat(c, &r); break;
    case 'C': op_mkdir(c, &r); break;
    case 'V': op_rename(c, &r); break;
    case 'a': op_write_attrs(c, &r); break;
    case 'l': op_list_long(c, &r); break;
    case 's': op_stat_long(c, &r); break;
    case 'A': op_attach(c, &r); return; /* like exec: keeps the connection */
    case 'Y': op_watch(c, &r); return; /* keeps the connection until the client closes it */
    case 'I': op_stdin(c, &r); break;
    case 'U': op_signal(c, &r); break;
    case 'J': op_procs(c, &r); break;
    default: c->close_after = 1; reply_err(c, EPROTO, "unknown request type 0x%02x", c->req[0]); break;
    }
    finish(c);
}

/* ------------------------------------------------------------------ event handlers */

static void conn_read(struct conn *c)
{
    for (;;) {
        uint8_t *dst;
        size_t want;
        if (c->state == ST_HDR) {
            dst = c->hdr + c->hdr_got;
            want = 4 - c->hdr_got;
        } else if (c->state == ST_BODY) {
            dst = c->req + c->req_got;
            want = c->req_len - c->req_got;
        } else {
            /* Mid-exec the client only ever goes away; any bytes it sends are ignored. */
            uint8_t scratch[4096];
            dst = scratch;
            want = sizeof scratch;
            ssize_t n = read(c->fd, dst, want);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
                conn_close(c);
                return;
            }
            if (n < 0 && errno == EINTR)
                continue;
            return;
        }
        ssize_t n = read(c->fd, dst, want);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        if (n <= 0) {
            conn_close(c);
            return;
        }
        if (c->state == ST_HDR) {
            c->hdr_got += (uint32_t)n;
            if (c->hdr_got < 4)
                continue;
            uint32_t len = (uint32_t)c->hdr[0] << 24 | (uint32_t)c->hdr[1] << 16 | (uint32_t)c->hdr[2] << 8 | c->hdr[3];
            if (len == 0 || len > MAX_REQ) {
                c->close_after = 1;
                if (len)
                    reply_err(c, EMSGSIZE, "request frame of %u bytes exceeds %u", len, MAX_REQ);
                else
                    reply_err(c, EPROTO, "empty request frame");
                finish(c);
                return;
            }
            c->req = malloc(len);
            if (!c->req) {
                c->close_after = 1;
                reply_err(c, ENOMEM, "out of memory");
                finish(c);
                return;
            }
            c->req_len = len;
            c->req_got = 0;
            c->state = ST_BODY;
        } else {
            c->req_got += (uint32_t)n;
            if (c->req_got == c->req_len) {
                dispatch(c);
                return;
            }
        }
    }
}

static void on_conn(struct conn *c, uint32_t ev)
{
    if (ev & EPOLLOUT) {
        conn_flush(c);
        if (c->dead)
            return;
    }
    if (c->state == ST_CLOSING) {
        if (ev & (EPOLLHUP | EPOLLERR))
            conn_close(c);
        return;
    }
    if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))
        conn_read(c);
}

static void conn_new(int fd)
{
    struct conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        return;
    }
    c->fd = fd;
    c->ifd = -1;
    c->state = ST_HDR;
    c->w = (struct watch){W_CONN, c, NULL};
    c->events = EPOLLIN | EPOLLRDHUP;
    ep_ctl(EPOLL_CTL_ADD, fd, &c->w, c->events);
}

static void on_listen(void)
{
    for (int i = 0; i < 64; i++) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            conn_new(fd);
            continue;
        }
        if (errno == EINTR)
            continue;
        if ((errno == EMFILE || errno == ENFILE) && reserve_fd >= 0) {
            /* Out of fds: a level-triggered listener would spin forever, so spend the reserved
             * fd to accept and refuse one connection with a proper error. */
            close(reserve_fd);
            reserve_fd = -1;
            fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0) {
                static const char msg[] = "agent out of file descriptors";
                uint8_t buf[64];
                be32(buf, 1 + 4 + 4 + sizeof msg - 1);
                buf[4] = 'R';
                be32(buf + 5, EMFILE);
                be32(buf + 9, sizeof msg - 1);
                memcpy(buf + 13, msg, sizeof msg - 1);
                send(fd, buf, 13 + sizeof msg - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
                close(fd);
            }
            reserve_fd = fcntl(devnull, F_DUPFD_CLOEXEC, 0);
            continue;
        }
        return;
    }
}

static void shutdown_now(void)
{
    for (struct proc *p = procs; p; p = p->next)
        if (p->pid > 0)
            kill(-p->pid, SIGKILL);
    struct stat st;
    if (fstatat(sock_dirfd, sock_base, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == sock_dev && st.st_ino == sock_ino)
        unlinkat(sock_dirfd, sock_base, 0);
    _exit(0);
}

static void reap(void)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (struct proc *p = procs; p; p = p->next) {
            if (p->pid == pid) {
                proc_exited(p, status);
                break;
            }
        }
    }
}

static void on_signal(void)
{
    struct signalfd_siginfo si[16];
    ssize_t n;
    while ((n = read(sfd, si, sizeof si)) > 0) {
        for (size_t i = 0; i < (size_t)n / sizeof si[0]; i++)
            if (si[i].ssi_signo == SIGTERM || si[i].ssi_signo == SIGINT)
                shutdown_now();
        if ((size_t)n < sizeof si)
            break; /* drained: no read just to hear EAGAIN */
    }
    reap();
}

/* ------------------------------------------------------------------ setup */

/* Milliseconds until the next timer of any command (-1: none), for epoll_wait. */
static int timers_due(void)
{
    int64_t next = 0;
    for (struct proc *p = procs; p; p = p->next)
        if (p->next_timer && (!next || p->next_timer < next))
            next = p->next_timer;
    if (!next)
        return -1;
    int64_t left = next - now_ns();
    return left <= 0 ? 0 : (int)((left + 999999) / 1000000 > 86400000 ? 86400000 : (left + 999999) / 1000000);
}

static void run_timers(void)
{
    int64_t now = now_ns();
    for (struct proc *p = procs, *next; p; p = next) {
        next = p->next; /* on_timer may free p (never another command) */
        if (p->next_timer && now >= p->next_timer && !p->dead)
            on_timer(p, now);
    }
}

static void die(const char *what)
{
    char msg[512];
    int n = snprintf(msg, sizeof msg, "dsec-agent: %s: %s\n", what, strerror(errno));
    if (n < 0)
        exit(1);
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    (void)!write(2, msg, (size_t)n);
    /* Also beside our socket, where the host reads them at once: what the runtime's shim copies
     * from stderr into the host's log was sometimes never there (containerd 1.6, a busy host). */
    if (sock_base) {
        int fd = openat(sock_dirfd, AGENT_LAST_WORDS, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0) {
            (void)!write(fd, msg, (size_t)n);
            close(fd);
        }
    }
    exit(1);
}

static void setup_socket(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    const char *slash = strrchr(path, '/');
    sock_base = slash ? slash + 1 : path;
    if (!*sock_base) {
        errno = EINVAL;
        die("socket path");
    }
    if (strlen(path) < sizeof sa.sun_path) {
        snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
        if (slash) {
            /* Keep a handle on the directory for the unlink at shutdown, even if cwd changes. */
            char *dir = strndup(path, (size_t)(slash - path));
            sock_dirfd = open(*dir ? dir : "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
            free(dir);
            if (sock_dirfd < 0)
                die("socket directory");
        }
    } else {
        /* sun_path is 108 bytes; longer paths are reached through the directory's fd. */
        char *dir = strndup(path, slash ? (size_t)(slash - path) : 1);
        sock_dirfd = open(slash ? (*dir ? dir : "/") : ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
        free(dir);
        if (sock_dirfd < 0)
            die("socket directory");
        if ((size_t)snprintf(sa.sun_path, sizeof sa.sun_path, "/proc/self/fd/%d/%s", sock_dirfd, sock_base) >= sizeof sa.sun_path) {
            errno = ENAMETOOLONG;
            die("socket path");
        }
    }
    if (unlinkat(sock_dirfd, sock_base, 0) < 0 && errno != ENOENT)
        die("remove stale socket");
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0)
        die("socket");
    mode_t old = umask(0177);
    int rc = bind(lfd, (struct sockaddr *)&sa, sizeof sa);
    umask(old);
    if (rc < 0)
        die("bind");
    fchmodat(sock_dirfd, sock_base, 0600, 0);
    struct stat st;
    if (fstatat(sock_dirfd, sock_base, &st, AT_SYMLINK_NOFOLLOW) < 0)
        die("stat socket");
    sock_dev = st.st_dev;
    sock_ino = st.st_ino;
    if (listen(lfd, SOMAXCONN) < 0)
        die("listen");
}

/* ------------------------------------------------------------------ confinement */

/* Landlock UAPI, spelled out: the build host's headers may predate the ABI the kernel offers. */
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif
#define LL_CREATE_RULESET_VERSION (1u << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_FS_EXECUTE (1ull << 0)
#define LL_FS_WRITE_FILE (1ull << 1)
#define LL_FS_READ_FILE (1ull << 2)
#define LL_FS_READ_DIR (1ull << 3)
#define LL_FS_REMOVE_DIR (1ull << 4)
#define LL_FS_REMOVE_FILE (1ull << 5)
#define LL_FS_MAKE_CHAR (1ull << 6)
#define LL_FS_MAKE_DIR (1ull << 7)
#define LL_FS_MAKE_REG (1ull << 8)
#define LL_FS_MAKE_SOCK (1ull << 9)
#define LL_FS_MAKE_FIFO (1ull << 10)
#define LL_FS_MAKE_BLOCK (1ull << 11)
#define LL_FS_MAKE_SYM (1ull << 12)
#define LL_FS_REFER (1ull << 13)    /* ABI 2 */
#define LL_FS_TRUNCATE (1ull << 14) /* ABI 3 */
#define LL_FS_IOCTL_DEV (1ull << 15) /* ABI 5 */
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ull << 0) /* ABI 6 */
#define LL_SCOPE_SIGNAL (1ull << 1)              /* ABI 6 */
#define LL_RESTRICT_SELF_LOG_NEW_EXEC_ON (1u << 1) /* ABI 7 */
/* Rights that make sense on a non-directory. */
#define LL_FILE_RIGHTS (LL_FS_EXECUTE | LL_FS_WRITE_FILE | LL_FS_READ_FILE | LL_FS_TRUNCATE | LL_FS_IOCTL_DEV)

struct ll_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net; /* ABI 4 */
    uint64_t scoped;             /* ABI 6 */
};

struct ll_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

#define MAX_FS_RULES 64
enum { FS_RO, FS_RW, FS_DEV };
static struct {
    const char *path;
    int kind;
} fs_rules[MAX_FS_RULES];
static int n_fs_rules, landlock_required;
static const char *seccomp_hex;
static long audit_loginuid = -1;
static int allow_setuid;
static uint64_t setup_caps; /* bit N: --setup-cap N */

/* no_new_privs, unless --allow-setuid: then the filters below are installed on CAP_SYS_ADMIN
 * (refused without it: the sandbox does not start rather than run without them). */
static void set_no_new_privs(void)
{
    if (!allow_setuid && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("PR_SET_NO_NEW_PRIVS");
}

static void add_fs_rule(const char *path, int kind)
{
    if (n_fs_rules == MAX_FS_RULES || path[0] != '/') {
        fprintf(stderr, "dsec-agent: bad or too many --landlock-* paths (max %d, absolute)\n", MAX_FS_RULES);
        exit(2);
    }
    fs_rules[n_fs_rules].path = path;
    fs_rules[n_fs_rules].kind = kind;
    n_fs_rules++;
}

static int mkdir_all(const char *path, mode_t mode)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p)
            continue;
        char saved = *p;
        *p = 0;
        if (mkdir(buf, mode) < 0 && errno != EEXIST)
            return -1;
        if (!saved)
            return 0;
        *p = saved;
    }
}

static void apply_landlock(void)
{
    if (!n_fs_rules)
        return;
    int abi = (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
    if (abi < 1) {
        if (landlock_required)
            die("Landlock is required by the sandbox profile but the kernel does not offer it");
        fprintf(stderr, "dsec-agent: Landlock unavailable (%s); filesystem rules NOT enforced\n", strerror(errno));
        return;
    }
    uint64_t handled = (LL_FS_MAKE_SYM << 1) - 1; /* ABI 1: bits 0..12 */
    if (abi >= 2)
        handled |= LL_FS_REFER;
    if (abi >= 3)
        handled |= LL_FS_TRUNCATE;
    if (abi >= 5)
        handled |= LL_FS_IOCTL_DEV;
    struct ll_ruleset_attr attr = {.handled_access_fs = handled};
    size_t attr_size = abi >= 6 ? sizeof attr : abi >= 4 ? 16 : 8;
    if (abi >= 6)
        attr.scoped = LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL;
    int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0);
    if (rs < 0)
        die("landlock_create_ruleset");

    const uint64_t ro = LL_FS_EXECUTE | LL_FS_READ_FILE | LL_FS_READ_DIR;
    const uint64_t rw = handled & ~(LL_FS_MAKE_CHAR | LL_FS_MAKE_BLOCK);
    const uint64_t dev = (LL_FS_READ_FILE | LL_FS_READ_DIR | LL_FS_WRITE_FILE | LL_FS_TRUNCATE | LL_FS_IOCTL_DEV) & handled;
    for (int i = 0; i < n_fs_rules; i++) {
        const char *p = fs_rules[i].path;
        int kind = fs_rules[i].kind;
        int fd = open(p, O_PATH | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT && kind == FS_RW) {
            /* A writable path the image lacks (say /workspace): make it, world-writable+sticky
             * like /tmp when its name says it is a temp dir. */
            const char *base = strrchr(p, '/');
            mode_t mode = base && strstr(base, "tmp") ? 01777 : 0755;
            if (mkdir_all(p, 0755) == 0) {
                chmod(p, mode);
                fd = open(p, O_PATH | O_CLOEXEC);
            }
        }
        if (fd < 0) {
            if (errno == ENOENT || errno == ENOTDIR)
                continue; /* nothing there: nothing to grant */
            die(p);
        }
        struct stat st;
        if (fstat(fd, &st) < 0)
            die(p);
        struct ll_path_beneath_attr pb = {
            .allowed_access = kind == FS_RO ? ro : kind == FS_RW ? rw : dev,
            .parent_fd = fd,
        };
        if (!S_ISDIR(st.st_mode))
            pb.allowed_access &= LL_FILE_RIGHTS;
        pb.allowed_access &= handled;
        if (pb.allowed_access && syscall(SYS_landlock_add_rule, rs, LL_RULE_PATH_BENEATH, &pb, 0) < 0)
            die("landlock_add_rule");
        close(fd);
    }
    set_no_new_privs();
    unsigned flags = abi >= 7 ? LL_RESTRICT_SELF_LOG_NEW_EXEC_ON : 0;
    if (syscall(SYS_landlock_restrict_self, rs, flags) < 0)
        die("landlock_restrict_self");
    close(rs);
    conf_landlock_abi = abi;
    conf_flags |= CONF_LANDLOCK;
}

static int hexval(char ch)
{
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
}

static void apply_seccomp_log_filter(void)
{
    if (!seccomp_hex)
        return;
    size_t n = strlen(seccomp_hex);
    if (n == 0 || n % (2 * sizeof(struct sock_filter)) || n / 2 / sizeof(struct sock_filter) > BPF_MAXINSNS) {
        errno = EINVAL;
        die("--seccomp-bpf");
    }
    unsigned char *buf = malloc(n / 2);
    if (!buf)
        die("malloc");
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(seccomp_hex[2 * i]), lo = hexval(seccomp_hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            errno = EINVAL;
            die("--seccomp-bpf");
        }
        buf[i] = (unsigned char)(hi << 4 | lo);
    }
    struct sock_fprog prog = {.len = (unsigned short)(n / 2 / sizeof(struct sock_filter)), .filter = (struct sock_filter *)buf};
    set_no_new_privs();
    /* FLAG_LOG: the kernel audits every non-allow action of this filter (runc 1.1 cannot ask
     * for that on its own filter); being the newest filter, ours decides ties, so its
     * refusals are the ones logged. */
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_LOG, &prog) < 0)
        die("seccomp(SECCOMP_SET_MODE_FILTER)");
    free(buf);
    conf_flags |= CONF_SECCOMP_LOG;
}

static void set_audit_session(void)
{
    if (audit_loginuid < 0)
        return;
    char v[32];
    int n = snprintf(v, sizeof v, "%ld", audit_loginuid);
    int fd = open("/proc/self/loginuid", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, v, (size_t)n) != n) {
        /* Already set (a host agent started from a login session) or no audit support: the
         * host falls back to mapping live pids through their cgroup. */
        fprintf(stderr, "dsec-agent: cannot set audit loginuid: %s\n", strerror(errno));
    } else {
        conf_flags |= CONF_AUDIT_SESSION;
    }
    if (fd >= 0)
        close(fd);
}

#include <linux/capability.h>

/* Drop the --setup-cap capabilities from every set: the bounding set first (so no execve can give
 * them back), then permitted, effective and inheritable (ambient ones go with those). */
static void drop_setup_caps(void)
{
    if (!setup_caps)
        return;
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    if (syscall(SYS_capget, &hdr, data) < 0)
        die("capget");
    for (int cap = 0; cap < 64; cap++) {
        if (!(setup_caps >> cap & 1))
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0)
            die("PR_CAPBSET_DROP");
        uint32_t bit = 1u << (cap % 32);
        data[cap / 32].permitted &= ~bit;
        data[cap / 32].effective &= ~bit;
        data[cap / 32].inheritable &= ~bit;
    }
    if (syscall(SYS_capset, &hdr, data) < 0)
        die("capset");
}

/* Order matters: the session id first (Landlock then forbids writing /proc), Landlock next,
 * the seccomp filter last (it may refuse calls the steps before need), then the capabilities
 * lent for them go. */
static void apply_confinement(void)
{
    set_audit_session();
    apply_landlock();
    apply_seccomp_log_filter();
    drop_setup_caps();
}


/* ------------------------------------------------------------------ pty helper modes
 * The agent binary doubles as the pty relay of envd's PTY sessions (the gateway starts
 * `exec dsec-agent --pty ROWS COLS CMD [ARG...]` as an ordinary command with a stdin pipe):
 *   --pty ROWS COLS CMD...        CMD runs in a new session on a new pty of that size; stdin is
 *                                 copied to the pty, the pty's output to stdout; exits as CMD did
 *                                 (128+signal if killed). A SIGTERM/SIGINT/SIGHUP is passed on.
 *   --pty-resize PID ROWS COLS    resize the pty of the relay PID's command (its SIGWINCH follows)
 */
#include <poll.h>
#include <sys/ioctl.h>
#include <termios.h>

static volatile pid_t pty_child;

static void pty_forward(int sig)
{
    if (pty_child > 0)
        kill(pty_child, sig);
}

static int pty_size(const char *rows, const char *cols, struct winsize *ws)
{
    long r = strtol(rows, NULL, 10), c = strtol(cols, NULL, 10);
    if (r <= 0 || c <= 0 || r > 65535 || c > 65535)
        return -1;
    *ws = (struct winsize){.ws_row = (unsigned short)r, .ws_col = (unsigned short)c};
    return 0;
}

static int pty_run(int argc, char **argv)
{
    struct winsize ws;
    if (argc < 5 || pty_size(argv[2], argv[3], &ws) < 0) {
        fprintf(stderr, "usage: dsec-agent --pty ROWS COLS CMD [ARG...]\n");
        return 2;
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0 || grantpt(m) < 0 || unlockpt(m) < 0 || ioctl(m, TIOCSWINSZ, &ws) < 0) {
        perror("dsec-agent: pty");
        return 1;
    }
    const char *slave = ptsname(m);
    pid_t pid = slave ? fork() : -1;
    if (pid < 0) {
        perror("dsec-agent: pty fork");
        return 1;
    }
    if (pid == 0) {
        setsid();
        int s = open(slave, O_RDWR);
        if (s < 0 || ioctl(s, TIOCSCTTY, 0) < 0 || dup2(s, 0) < 0 || dup2(s, 1) < 0 || dup2(s, 2) < 0) {
            perror("dsec-agent: pty slave");
            _exit(127);
        }
        if (s > 2)
            close(s);
        execvp(argv[4], argv + 4);
        fprintf(stderr, "dsec-agent: %s: %s\n", argv[4], strerror(errno));
        _exit(127);
    }
    pty_child = pid;
    struct sigaction sa = {.sa_handler = pty_forward};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    char buf[65536];
    struct pollfd fds[2] = {{.fd = m, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
    for (;;) {
        int n = poll(fds, 2, -1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            break;
        if (fds[0].revents) {
            ssize_t got = read(m, buf, sizeof buf);
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0)
                break; /* EIO: every holder of the slave closed it (the command ended) */
            for (ssize_t off = 0; off < got;) {
                ssize_t w = write(1, buf + off, (size_t)(got - off));
                if (w < 0 && errno == EINTR)
                    continue;
                if (w <= 0)
                    break;
                off += w;
            }
        }
        if (fds[1].revents) {
            ssize_t got = read(0, buf, sizeof buf);
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0)
                fds[1].fd = -1; /* stdin closed: the pty stays open until the command ends */
            for (ssize_t off = 0; off < got;) {
                ssize_t w = write(m, buf + off, (size_t)(got - off));
                if (w < 0 && errno == EINTR)
                    continue;
                if (w <= 0)
                    break;
                off += w;
            }
        }
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

/* 0 when the pty of relay's child took the size; -1 while there is no such child (yet). */
static int pty_resize_once(long relay, const struct winsize *ws)
{
    DIR *d = opendir("/proc");
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char path[64], stat_line[512];
        snprintf(path, sizeof path, "/proc/%.20s/stat", de->d_name);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        size_t n = fread(stat_line, 1, sizeof stat_line - 1, f);
        fclose(f);
        stat_line[n] = 0;
        const char *close_paren = strrchr(stat_line, ')');
        long ppid = 0;
        if (!close_paren || sscanf(close_paren + 1, " %*c %ld", &ppid) != 1 || ppid != relay)
            continue;
        snprintf(path, sizeof path, "/proc/%.20s/fd/0", de->d_name);
        int s = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (s >= 0 && isatty(s) && ioctl(s, TIOCSWINSZ, ws) == 0) {
            close(s);
            closedir(d);
            return 0;
        }
        if (s >= 0)
            close(s);
    }
    if (d)
        closedir(d);
    return -1;
}

static int pty_resize(int argc, char **argv)
{
    struct winsize ws;
    long relay = argc == 5 ? strtol(argv[2], NULL, 10) : 0;
    if (relay <= 0 || pty_size(argv[3], argv[4], &ws) < 0) {
        fprintf(stderr, "usage: dsec-agent --pty-resize PID ROWS COLS\n");
        return 2;
    }
    /* A session resized right after its start may not have forked its command yet: retry for 2 s. */
    for (int i = 0; i < 40; i++) {
        if (pty_resize_once(relay, &ws) == 0)
            return 0;
        if (kill((pid_t)relay, 0) < 0)
            break;
        usleep(50000);
    }
    fprintf(stderr, "dsec-agent: no pty session of process %ld\n", relay);
    return 1;
}

/* ------------------------------------------------------------------ microVM: init and serial mux
 *
 * In a microVM (the microvm backend) this binary is the initramfs's /init. vm_boot() mounts the
 * root (the template's read-only EROFS layers, each a virtio disk with serial "layer<i>", bottom
 * first, under an overlay whose upper dir is on the ext4 disk with serial "upper"), moves into it,
 * and forks vm_mux(); main then serves the usual protocol on a unix socket inside the guest.
 *
 * The guest has no vsock: the host reaches the agent through one virtio-serial port (named
 * "dsec.agent"), a single byte stream the mux splits into the host's connections:
 *
 *   mux frame := u32 channel | u32 n | n bytes        big-endian
 *
 * A channel's first frame from the host opens a connection to the agent's socket; n = 0 closes
 * it (either way). Channel 0xffffffff is the link's own: the host sends a reset carrying a nonce
 * when it (re)connects; the mux closes every connection and answers "DSECMUX1" + the nonce, so the
 * host can skip whatever an earlier host process left half-read in the stream. */
#include <poll.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>

#define VM_LINK 0xffffffffu
#define VM_MAXCH 128
#define VM_CHUNK 65536
#define VM_SOCK "/run/dsec/agent.sock"

static void vm_die(const char *what)
{
    fprintf(stderr, "dsec-agent (vm): %s: %s\n", what, strerror(errno));
    sync();
    reboot(RB_AUTOBOOT); /* -no-reboot: QEMU exits, and the host sees the boot fail */
    _exit(1);
}

static uint32_t vm_get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

static int vm_read_small(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t r = read(fd, buf, n - 1);
    close(fd);
    if (r < 0)
        return -1;
    while (r > 0 && (buf[r - 1] == '\n' || buf[r - 1] == ' '))
        r--;
    buf[r] = 0;
    return 0;
}

/* Modules the initramfs carries (/lib/dsec/modules, one path a line, dependencies first). */
static void vm_load_modules(void)
{
    FILE *f = fopen("/lib/dsec/modules", "re");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!*line)
            continue;
        int fd = open(line, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            vm_die(line);
        if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST)
            vm_die(line);
        close(fd);
    }
    fclose(f);
}

/* /dev/<name> of the entry under `cls` whose `attr` file reads `want`; waits for it a while
 * (drivers probe as their modules load, devtmpfs makes the node). */
static void vm_find(const char *cls, const char *attr, const char *want, char *out, size_t n)
{
    for (int tries = 0; tries < 1000; tries++) {
        DIR *d = opendir(cls);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            char p[600], v[128];
            if (e->d_name[0] == '.')
                continue;
            snprintf(p, sizeof p, "%s/%s/%s", cls, e->d_name, attr);
            if (vm_read_small(p, v, sizeof v) == 0 && !strcmp(v, want)) {
                snprintf(out, n, "/dev/%s", e->d_name);
                closedir(d);
                if (access(out, F_OK) == 0)
                    return;
                d = NULL;
                break;
            }
        }
        if (d)
            closedir(d);
        usleep(10000);
    }
    errno = ENODEV;
    vm_die(want);
}

static void vm_mount(const char *src, const char *dst, const char *type, unsigned long flags, const char *data)
{
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, data) < 0)
        vm_die(dst);
}

/* /dev/pmemN of the virtio-pmem device in PCI slot `slot` (the host gives layer i slot 0x10+i: pmem
 * numbers follow probe order, which the async nvdimm bus does not keep); waits for it a while. */
static void vm_find_pmem(int slot, char *out, size_t n)
{
    char want[32];
    snprintf(want, sizeof want, ":%02x.0/", slot);
    for (int tries = 0; tries < 2000; tries++) {
        DIR *d = opendir("/sys/block");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            char p[300], link[600];
            if (strncmp(e->d_name, "pmem", 4))
                continue;
            snprintf(p, sizeof p, "/sys/block/%s", e->d_name);
            ssize_t k = readlink(p, link, sizeof link - 1);
            if (k <= 0)
                continue;
            link[k] = 0;
            snprintf(out, n, "/dev/%s", e->d_name);
            if (strstr(link, want) && access(out, F_OK) == 0) {
                closedir(d);
                return;
            }
        }
        if (d)
            closedir(d);
        usleep(10000);
    }
    errno = ENODEV;
    vm_die("pmem layer");
}

static void vm_loopback_up(void)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP;
        ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    if (s >= 0)
        close(s);
}

/* The NIC the host gave this VM (a tap in the sandbox's netns, bridged to the host's veth, whose
 * host side carries the egress rules): eth0 gets dsec_ip (a /30) and a default route via dsec_gw.
 * No IPv6 (the host side drops it anyway). */
static void vm_net_up(const char *ip, const char *gw)
{
    int fd = open("/proc/sys/net/ipv6/conf/all/disable_ipv6", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "1", 1) < 0) { /* no IPv6 in this kernel: nothing to turn off */
        }
        close(fd);
    }
    for (int tries = 0; if_nametoindex("eth0") == 0; tries++) { /* virtio_net probes as it loads */
        if (tries >= 1000) {
            errno = ENODEV;
            vm_die("eth0");
        }
        usleep(10000);
    }
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "eth0");
    struct sockaddr_in *sa = (struct sockaddr_in *)&ifr.ifr_addr;
    sa->sin_family = AF_INET;
    if (s < 0 || inet_pton(AF_INET, ip, &sa->sin_addr) != 1 || ioctl(s, SIOCSIFADDR, &ifr) < 0)
        vm_die("eth0 address");
    inet_pton(AF_INET, "255.255.255.252", &sa->sin_addr); /* the host hands out /30s */
    if (ioctl(s, SIOCSIFNETMASK, &ifr) < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        vm_die("eth0 netmask");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        vm_die("eth0 up");
    struct rtentry rt;
    memset(&rt, 0, sizeof rt);
    ((struct sockaddr_in *)&rt.rt_dst)->sin_family = AF_INET;
    ((struct sockaddr_in *)&rt.rt_genmask)->sin_family = AF_INET;
    struct sockaddr_in *g = (struct sockaddr_in *)&rt.rt_gateway;
    g->sin_family = AF_INET;
    if (inet_pton(AF_INET, gw, &g->sin_addr) != 1)
        vm_die("gateway");
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    if (ioctl(s, SIOCADDRT, &rt) < 0)
        vm_die("default route");
    close(s);
}

static int vm_write_all(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int vm_send(int port, uint32_t ch, const void *data, uint32_t n)
{
    uint8_t h[8];
    be32(h, ch);
    be32(h + 4, n);
    return vm_write_all(port, h, 8) < 0 || (n && vm_write_all(port, data, n) < 0) ? -1 : 0;
}

static int vm_connect_agent(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, VM_SOCK);
    for (int tries = 0; tries < 500; tries++) { /* the agent binds its socket just after the fork */
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return -1;
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
            return fd;
        close(fd);
        if (errno != ENOENT && errno != ECONNREFUSED)
            return -1;
        usleep(10000);
    }
    return -1;
}

static void vm_mux(const char *port_path)
{
    int port = open(port_path, O_RDWR | O_CLOEXEC);
    if (port < 0)
        vm_die(port_path);
    uint32_t ids[VM_MAXCH];
    int fds[VM_MAXCH], nch = 0;
    static uint8_t in[4 * VM_CHUNK], tmp[VM_CHUNK];
    size_t have = 0;
    for (;;) {
        struct pollfd pf[1 + VM_MAXCH];
        pf[0] = (struct pollfd){port, POLLIN, 0};
        for (int i = 0; i < nch; i++)
            pf[1 + i] = (struct pollfd){fds[i], POLLIN, 0};
        if (poll(pf, 1 + nch, -1) < 0) {
            if (errno == EINTR)
                continue;
            vm_die("poll");
        }
        ssize_t r = 0;
        if (pf[0].revents & POLLIN && !(pf[0].revents & POLLHUP))
            r = read(port, in + have, sizeof in - have);
        if (pf[0].revents & POLLHUP || (pf[0].revents & POLLIN && r <= 0 && !(r < 0 && errno == EINTR))) {
            /* No host on the other end (a host agent restarting): drop its connections, wait. */
            for (int i = 0; i < nch; i++)
                close(fds[i]);
            nch = 0;
            have = 0;
            usleep(20000);
            continue;
        }
        if (r > 0)
            have += (size_t)r;
        size_t off = 0;
        while (have - off >= 8) {
            uint32_t ch = vm_get32(in + off), n = vm_get32(in + off + 4);
            if (n > VM_CHUNK * 3) { /* not a frame of ours: wait for the host's reset */
                have = off = 0;
                break;
            }
            if (have - off < 8 + n)
                break;
            const uint8_t *data = in + off + 8;
            off += 8 + n;
            int i = 0;
            while (i < nch && ids[i] != ch)
                i++;
            if (ch == VM_LINK) {
                for (int j = 0; j < nch; j++)
                    close(fds[j]);
                nch = 0;
                uint8_t m[16] = "DSECMUX1";
                memcpy(m + 8, data, n < 8 ? n : 8);
                vm_send(port, VM_LINK, m, 16);
                continue;
            }
            if (n == 0) {
                if (i < nch) {
                    close(fds[i]);
                    fds[i] = fds[nch - 1];
                    ids[i] = ids[nch - 1];
                    nch--;
                }
                continue;
            }
            if (i == nch) {
                int fd = nch < VM_MAXCH ? vm_connect_agent() : -1;
                if (fd < 0) {
                    vm_send(port, ch, NULL, 0);
                    continue;
                }
                ids[nch] = ch;
                fds[nch++] = fd;
            }
            if (vm_write_all(fds[i], data, n) < 0) {
                close(fds[i]);
                fds[i] = fds[nch - 1];
                ids[i] = ids[nch - 1];
                nch--;
                vm_send(port, ch, NULL, 0);
            }
        }
        memmove(in, in + off, have - off);
        have -= off;
        for (int i = nch - 1; i >= 0; i--) {
            if (!pf[1 + i].revents || i >= nch)
                continue;
            ssize_t got = read(fds[i], tmp, sizeof tmp);
            if (got < 0 && errno == EINTR)
                continue;
            if (got > 0) {
                vm_send(port, ids[i], tmp, (uint32_t)got);
                continue;
            }
            vm_send(port, ids[i], NULL, 0);
            close(fds[i]);
            fds[i] = fds[nch - 1];
            ids[i] = ids[nch - 1];
            nch--;
        }
    }
}

/* PID 1 of a microVM: the root, then the mux; returns the agent's socket path. */
static const char *vm_boot(void)
{
    vm_mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
    vm_mount("proc", "/proc", "proc", 0, NULL);
    vm_mount("sysfs", "/sys", "sysfs", 0, NULL);
    int con = open("/dev/console", O_RDWR | O_CLOEXEC);
    if (con >= 0) {
        dup2(con, 1);
        dup2(con, 2);
        close(con);
    }
    vm_load_modules();
    if (getenv("dsec_probe")) { /* the host's timed boot that tells whether its accelerator works */
        printf("dsec-probe-ok\n");
        fflush(stdout);
        reboot(RB_AUTOBOOT);
        _exit(0);
    }
    char dev[300], dst[64];
    vm_find("/sys/block", "serial", "upper", dev, sizeof dev);
    vm_mount(dev, "/mnt/rw", "ext4", MS_NOATIME, NULL);
    mkdir("/mnt/rw/upper", 0755);
    mkdir("/mnt/rw/work", 0755);
    int layers = getenv("dsec_layers") ? atoi(getenv("dsec_layers")) : 0;
    /* dsec_pmem: the layers are virtio-pmem regions; with DAX the guest reads the host's page cache
     * in place (no copy in guest RAM). What each layer got is left in /run/dsec/layers for the host. */
    int pmem = getenv("dsec_pmem") != NULL;
    char report[1024] = "";
    for (int i = 0; i < layers; i++) {
        char want[32];
        const char *how = "blk";
        snprintf(dst, sizeof dst, "/mnt/l%d", i);
        if (pmem && i < 15) {
            vm_find_pmem(0x10 + i, dev, sizeof dev);
            mkdir(dst, 0755);
            how = "dax";
            if (mount(dev, dst, "erofs", MS_RDONLY, "dax=always") < 0) {
                how = "pmem"; /* no DAX: still the host's one copy, read into the guest's cache */
                vm_mount(dev, dst, "erofs", MS_RDONLY, NULL);
            }
        } else {
            snprintf(want, sizeof want, "layer%d", i);
            vm_find("/sys/block", "serial", want, dev, sizeof dev);
            vm_mount(dev, dst, "erofs", MS_RDONLY, NULL);
        }
        snprintf(report + strlen(report), sizeof report - strlen(report), "layer%d %s\n", i, how);
    }
    char opts[4200] = "lowerdir=";
    for (int i = layers - 1; i >= 0; i--) /* overlay wants the top layer first */
        snprintf(opts + strlen(opts), sizeof opts - strlen(opts), "/mnt/l%d%s", i, i ? ":" : "");
    snprintf(opts + strlen(opts), sizeof opts - strlen(opts), ",upperdir=/mnt/rw/upper,workdir=/mnt/rw/work");
    vm_mount("overlay", "/mnt/root", "overlay", 0, layers ? opts : NULL);
    const char *moved[] = {"/dev", "/proc", "/sys"};
    for (int i = 0; i < 3; i++) {
        snprintf(dst, sizeof dst, "/mnt/root%s", moved[i]);
        vm_mount(moved[i], dst, NULL, MS_MOVE, NULL);
    }
    if (chdir("/mnt/root") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0)
        vm_die("switch root");
    vm_mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666");
    vm_mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, NULL);
    vm_mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755");
    mkdir("/run/dsec", 0700);
    int rf = open("/run/dsec/layers", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (rf >= 0) {
        if (write(rf, report, strlen(report)) < 0) {
        }
        close(rf);
    }
    mkdir("/tmp", 01777);
    sethostname("sandbox", 7);
    vm_loopback_up();
    if (getenv("dsec_ip") && getenv("dsec_gw"))
        vm_net_up(getenv("dsec_ip"), getenv("dsec_gw"));
    vm_find("/sys/class/virtio-ports", "name", "dsec.agent", dev, sizeof dev);
    pid_t pid = fork();
    if (pid < 0)
        vm_die("fork");
    if (pid == 0) {
        vm_mux(dev);
        _exit(1);
    }
    return VM_SOCK;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--pty"))
        return pty_run(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "--pty-resize"))
        return pty_resize(argc, argv);
    const char *path = NULL;
    if (getpid() == 1 && !strcmp(argv[0], "/init")) { /* a microVM's init: no flags (the kernel's leftovers) */
        path = vm_boot();
        argc = 1;
    }
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc)
            path = argv[++i];
        else if (!strncmp(argv[i], "--socket=", 9))
            path = argv[i] + 9;
        else if (!strcmp(argv[i], "--heartbeat-ms") && i + 1 < argc && atoi(argv[i + 1]) > 0)
            heartbeat_ns = (int64_t)atoi(argv[++i]) * 1000000LL;
        else if (!strcmp(argv[i], "--landlock-ro") && i + 1 < argc)
            add_fs_rule(argv[++i], FS_RO);
        else if (!strcmp(argv[i], "--landlock-rw") && i + 1 < argc)
            add_fs_rule(argv[++i], FS_RW);
        else if (!strcmp(argv[i], "--landlock-dev") && i + 1 < argc)
            add_fs_rule(argv[++i], FS_DEV);
        else if (!strcmp(argv[i], "--landlock-required"))
            landlock_required = 1;
        else if (!strcmp(argv[i], "--seccomp-bpf") && i + 1 < argc)
            seccomp_hex = argv[++i];
        else if (!strcmp(argv[i], "--allow-setuid"))
            allow_setuid = 1;
        else if (!strcmp(argv[i], "--setup-cap") && i + 1 < argc && atoi(argv[i + 1]) >= 0 && atoi(argv[i + 1]) < 64)
            setup_caps |= 1ull << atoi(argv[++i]);
        else if (!strcmp(argv[i], "--audit-loginuid") && i + 1 < argc)
            audit_loginuid = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--confine-on-claim"))
            confine_deferred = 1;
        else if (!strcmp(argv[i], "--version")) {
            printf("dsec-agent protocol %d\n", PROTO_VERSION);
            return 0;
        } else {
            fprintf(stderr, "usage: dsec-agent --socket PATH [--heartbeat-ms N] [--landlock-ro|-rw|-dev PATH]... [--landlock-required] [--seccomp-bpf HEX] [--allow-setuid] [--setup-cap N]... [--audit-loginuid N] [--confine-on-claim]\n");
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "usage: dsec-agent --socket PATH [--heartbeat-ms N] [--landlock-ro|-rw|-dev PATH]... [--landlock-required] [--seccomp-bpf HEX] [--allow-setuid] [--setup-cap N]... [--audit-loginuid N] [--confine-on-claim]\n");
        return 2;
    }

    /* A container may start us with 0-2 closed; new fds must never land there, or a pipe
     * could become the agent's own "stdout" and dup2 onto itself in the child. */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
            break;

    /* Each running exec costs us four fds. Commands get the original limit back (spawn_shell):
     * some programs size tables by it or close every fd up to it. */
    if (getrlimit(RLIMIT_NOFILE, &child_nofile) == 0 && child_nofile.rlim_cur < child_nofile.rlim_max) {
        struct rlimit rl = child_nofile;
        rl.rlim_cur = rl.rlim_max < 65536 ? rl.rlim_max : 65536;
        if (rl.rlim_cur > child_nofile.rlim_cur && setrlimit(RLIMIT_NOFILE, &rl) == 0)
            restore_nofile = 1;
    }

    /* Not PID 1 (tests, debugging): still adopt orphaned grandchildren so they get reaped and
     * timeouts behave the same. */
    if (getpid() != 1)
        prctl(PR_SET_CHILD_SUBREAPER, 1);

    devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) {
        /* No /dev/null in this root: an empty pipe gives the same immediate EOF on stdin. */
        int p[2];
        if (pipe2(p, O_CLOEXEC) < 0)
            die("stdin pipe");
        close(p[1]);
        devnull = p[0];
    }
    reserve_fd = fcntl(devnull, F_DUPFD_CLOEXEC, 0);

    /* Dispositions set to SIG_IGN survive exec: clear any our parent left (SIGPIPE is the usual
     * one) so commands start with defaults without a per-spawn reset. We never need SIGPIPE:
     * socket writes use MSG_NOSIGNAL. */
    for (int sig = 1; sig < NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            signal(sig, SIG_DFL);

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    /* Blocked signals are queued even for PID 1 in a pid namespace (unblocked SIG_DFL ones are
     * dropped there), so the signalfd sees SIGTERM from the runtime. */
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
        die("sigprocmask");
    /* A write to a stdin pipe whose reader is gone then fails with EPIPE instead of killing us;
     * blocked, not ignored: spawn_shell clears the mask, an ignored disposition would survive
     * exec. */
    sigset_t pipe_mask;
    sigemptyset(&pipe_mask);
    sigaddset(&pipe_mask, SIGPIPE);
    sigprocmask(SIG_BLOCK, &pipe_mask, NULL);
    sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0)
        die("signalfd");

    setup_socket(path);
    if (!confine_deferred)
        apply_confinement();

    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0)
        die("epoll_create1");
    ep_ctl(EPOLL_CTL_ADD, lfd, &w_listen, EPOLLIN);
    ep_ctl(EPOLL_CTL_ADD, sfd, &w_signal, EPOLLIN);
    reap(); /* children inherited across exec (if any) */

    struct epoll_event evs[128];
    for (;;) {
        int n = epoll_wait(ep, evs, 128, timers_due());
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        run_timers();
        for (int i = 0; i < n; i++) {
            struct watch *w = evs[i].data.ptr;
            if (w->kind == W_LISTEN) {
                on_listen();
                continue;
            }
            if (w->kind == W_SIGNAL) {
                on_signal();
                continue;
            }
            if (w->p) {
                struct proc *p = w->p;
                if (p->dead)
                    continue;
                switch (w->kind) {
                case W_OUT: on_pipe(p, 1); break;
                case W_ERR: on_pipe(p, 2); break;
                case W_IN: stdin_flush(p); break;
                }
                continue;
            }
            struct conn *c = w->c;
            if (c->dead)
                continue;
            switch (w->kind) {
            case W_CONN: on_conn(c, evs[i].events); break;
            case W_INOTIFY: if (c->ifd >= 0) on_inotify(c); break;
            }
        }
        while (graveyard) {
            struct conn *c = graveyard;
            graveyard = c->next_dead;
            free(c->req);
            free(c->out);
            free(c);
        }
        while (proc_graveyard) {
            struct proc *p = proc_graveyard;
            proc_graveyard = p->next_dead;
            free(p->in);
            free(p->cmd);
            free(p->cwd);
            free(p->user);
            free(p);
        }
    }
}
