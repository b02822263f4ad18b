/*
 * sysx: make one raw system call and report the outcome (red-team helper for tests/security).
 *
 *   sysx [-32] NR [ARG...]
 *
 * -32 makes the call through the 32-bit x86 ABI (int $0x80) from this 64-bit binary, which is
 * how an attacker reaches the compat syscall table without a 32-bit toolchain.
 * ARG: an integer (decimal, 0x hex, may exceed 32 bits), or
 *      s:TEXT          pointer to a NUL-terminated copy of TEXT (in low memory, usable by -32)
 *      buf:N           pointer to N zero bytes
 *      hex:HEX         pointer to the bytes HEX spells (two hex digits a byte)
 *      fd:PATH:FLAGS   a descriptor from open(PATH, FLAGS, 0644) (FLAGS an integer)
 *      cat:PATH        a descriptor from open(PATH, O_RDONLY)
 * Prints "ret=R errno=E" and exits 0 if the call returned >= 0, else 1. A call the kernel kills
 * (seccomp) ends the process with SIGSYS (shell status 159).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

static char arena[1 << 16]; /* .bss of a static non-PIE binary: below 4 GiB */
static size_t used;

static void *low_alloc(size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (used + n > sizeof arena) {
        fprintf(stderr, "sysx: arena exhausted\n");
        exit(2);
    }
    void *p = arena + used;
    used += n;
    return p;
}

static unsigned long parse(const char *a)
{
    if (!strncmp(a, "s:", 2)) {
        char *p = low_alloc(strlen(a + 2) + 1);
        strcpy(p, a + 2);
        return (unsigned long)p;
    }
    if (!strncmp(a, "buf:", 4))
        return (unsigned long)low_alloc(strtoul(a + 4, NULL, 0));
    if (!strncmp(a, "hex:", 4)) {
        size_t n = strlen(a + 4) / 2;
        unsigned char *p = low_alloc(n);
        for (size_t k = 0; k < n; k++) {
            char byte[3] = {a[4 + 2 * k], a[5 + 2 * k], 0};
            p[k] = (unsigned char)strtoul(byte, NULL, 16);
        }
        return (unsigned long)p;
    }
    if (!strncmp(a, "cat:", 4)) {
        int fd = open(a + 4, O_RDONLY);
        if (fd < 0) {
            fprintf(stderr, "sysx: open %s: %s\n", a + 4, strerror(errno));
            exit(2);
        }
        return (unsigned long)fd;
    }
    if (!strncmp(a, "fd:", 3)) {
        char *path = strdup(a + 3);
        char *colon = strrchr(path, ':');
        int flags = 0;
        if (colon) {
            *colon = 0;
            flags = (int)strtol(colon + 1, NULL, 0);
        }
        int fd = open(path, flags, 0644);
        if (fd < 0) {
            fprintf(stderr, "sysx: open %s: %s\n", path, strerror(errno));
            exit(2);
        }
        return (unsigned long)fd;
    }
    return strtoull(a, NULL, 0);
}

int main(int argc, char **argv)
{
    int i = 1, compat = 0;
    if (i < argc && !strcmp(argv[i], "-32")) {
        compat = 1;
        i++;
    }
    if (i >= argc) {
        fprintf(stderr, "usage: sysx [-32] NR [ARG...]\n");
        return 2;
    }
    long nr = (long)parse(argv[i++]);
    unsigned long a[6] = {0};
    for (int k = 0; k < 6 && i < argc; k++, i++)
        a[k] = parse(argv[i]);
    long ret;
    int err = 0;
    if (compat) {
#if defined(__x86_64__)
        long r;
        __asm__ volatile("push %%rbp\n\tmov %7, %%rbp\n\tint $0x80\n\tpop %%rbp"
                         : "=a"(r)
                         : "a"(nr), "b"(a[0]), "c"(a[1]), "d"(a[2]), "S"(a[3]), "D"(a[4]), "g"(a[5])
                         : "memory", "r8", "r9", "r10", "r11");
        ret = (int)r; /* the compat ABI returns a 32-bit value */
        if (ret < 0 && ret > -4096) {
            err = (int)-ret;
            ret = -1;
        }
#else
        fprintf(stderr, "sysx: -32 is only implemented on x86_64\n");
        return 2;
#endif
    } else {
        errno = 0;
        ret = syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
        err = ret < 0 ? errno : 0;
    }
    printf("ret=%ld errno=%d (%s)\n", ret, err, err ? strerror(err) : "ok");
    return ret < 0 ? 1 : 0;
}
