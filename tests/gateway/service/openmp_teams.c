/* Preloaded into a `kvgate serve` by test_openmp_teams.py: logs when each thread's OpenMP team
   begins (its first parallel region, or its first after omp_pause_resource_all ended the team)
   and ends (that pause), one line an event, to the file $OPENMP_TEAMS_LOG:
       begin <tid> <CLOCK_MONOTONIC ns>
       end <tid> <ns>
   Both calls are passed on to the OpenMP runtime unchanged. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static __thread int holds_team;

static void log_event(const char *what) {
    const char *path = getenv("OPENMP_TEAMS_LOG");
    if (path == NULL) return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    FILE *f = fopen(path, "a");
    if (f == NULL) return;
    fprintf(f, "%s %ld %lld\n", what, (long)syscall(SYS_gettid),
            (long long)now.tv_sec * 1000000000LL + now.tv_nsec);
    fclose(f);
}

void GOMP_parallel(void (*fn)(void *), void *data, unsigned threads, unsigned flags) {
    static void (*real)(void (*)(void *), void *, unsigned, unsigned);
    if (real == NULL) real = dlsym(RTLD_NEXT, "GOMP_parallel");
    if (!holds_team) {
        holds_team = 1;
        log_event("begin");
    }
    real(fn, data, threads, flags);
}

int omp_pause_resource_all(int kind) {
    static int (*real)(int);
    if (real == NULL) real = dlsym(RTLD_NEXT, "omp_pause_resource_all");
    const int status = real(kind);
    if (status == 0 && holds_team) {
        holds_team = 0;
        log_event("end");
    }
    return status;
}
