/* forkflood: fork until the kernel refuses, report how far it got, then kill the whole flood.
 * Children just wait. Prints "forks=N errno=E". */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int limit = argc > 1 ? atoi(argv[1]) : 100000;
    int n = 0, err = 0;
    setpgid(0, 0);
    while (n < limit) {
        pid_t p = fork();
        if (p == 0) {
            pause();
            _exit(0);
        }
        if (p < 0) {
            err = errno;
            break;
        }
        n++;
    }
    printf("forks=%d errno=%d\n", n, err);
    fflush(stdout);
    signal(SIGTERM, SIG_IGN);
    kill(0, SIGKILL); /* the whole flood, ourselves included */
    return 0;
}
