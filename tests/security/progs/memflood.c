/* memflood: allocate and touch memory in 8 MiB steps until killed (or MAX MiB), printing the
 * running total (unbuffered) so the last line tells how far it got. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long max_mb = argc > 1 ? atol(argv[1]) : 1 << 20;
    setvbuf(stdout, NULL, _IONBF, 0);
    for (long mb = 8; mb <= max_mb; mb += 8) {
        char *p = malloc(8 << 20);
        if (!p) {
            printf("malloc failed at %ld MiB\n", mb);
            return 2;
        }
        memset(p, 0x5a, 8 << 20);
        printf("%ld\n", mb);
    }
    printf("done\n");
    return 0;
}
