/* A wall clock that can be stepped inside one process: LD_PRELOAD this library and set
 * hw_clock_offset_ns (ctypes.c_longlong.in_dll(ctypes.CDLL(None), "hw_clock_offset_ns")); every
 * read of CLOCK_REALTIME through libc (Python's time.time, gRPC's deadlines, gloo) is offset from
 * then on, as on a node whose clock NTP stepped. The monotonic clocks are left alone, as the
 * kernel leaves them. Built by tests/e2e/test_clock.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <sys/time.h>
#include <time.h>

long long hw_clock_offset_ns = 0;

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_nsec + hw_clock_offset_ns % 1000000000LL;
    ts->tv_sec += hw_clock_offset_ns / 1000000000LL + ns / 1000000000LL;
    ns %= 1000000000LL;
    if (ns < 0) {
        ns += 1000000000LL;
        ts->tv_sec -= 1;
    }
    ts->tv_nsec = ns;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (real == NULL) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && hw_clock_offset_ns != 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL) *out = ts.tv_sec;
    return ts.tv_sec;
}
