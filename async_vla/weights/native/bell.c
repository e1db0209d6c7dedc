/* Doorbell primitives for the same-host weight broadcast (async_vla/weights/bell.py), loaded with ctypes from
 * the same library as copysum.c.
 *
 * Why: on one host the bytes of a version already go through a shared-memory segment, but each version still
 * took three gloo round trips (header, acknowledgements, verdict) plus mailbox pushes through the TCPStore:
 * ~6 ms of wake-ups at 10M parameters, more than the copy itself. Here the publisher and its receivers
 * exchange a version through words of one shared page: atomics with release/acquire ordering, and futexes on
 * the shared mapping (FUTEX_WAIT without FUTEX_PRIVATE_FLAG: waiters live in other processes) so nobody spins.
 * Receivers sum their verification share while the publisher is still packing (`avla_follow_sum`), so the
 * check ends a moment after the last byte is written.
 *
 * Every wait is bounded (a slice); Python checks liveness, stop requests and deadlines between slices.
 * Linux only (futex); elsewhere the library still builds and `avla_bell_supported` returns 0.
 */
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AVLA_FUTEX 1
#endif

uint64_t avla_sum(const void *src, size_t n);   /* copysum.c */

int avla_bell_supported(void) {
#ifdef AVLA_FUTEX
    return 1;
#else
    return 0;
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int64_t avla_load_i64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void avla_store_i64(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
int32_t avla_load_i32(const int32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Sleep while *addr == expected, at most timeout_ns. 0: woken or the value differs; 1: timed out. */
int avla_futex_wait(int32_t *addr, int32_t expected, int64_t timeout_ns) {
#ifdef AVLA_FUTEX
    if (timeout_ns <= 0) return __atomic_load_n(addr, __ATOMIC_ACQUIRE) == expected;
    struct timespec ts = {(time_t)(timeout_ns / 1000000000LL), (long)(timeout_ns % 1000000000LL)};
    long r = syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
    if (r == -1 && errno == ETIMEDOUT) return 1;
    return 0;   /* woken, EAGAIN (value already changed) or EINTR: the caller re-reads */
#else
    (void)addr; (void)expected; (void)timeout_ns;
    return 1;
#endif
}

int avla_futex_wake(int32_t *addr) {
#ifdef AVLA_FUTEX
    return (int)syscall(SYS_futex, addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)addr;
    return 0;
#endif
}

/* Store v (release), then wake every waiter on the same word. For counters that mark events (post, ack, verdict):
 * a waiter that read the old value and then sleeps on it is woken, one that reads after the store sees v. */
void avla_set_wake(int32_t *word, int32_t v) {
    __atomic_store_n(word, v, __ATOMIC_SEQ_CST);
    avla_futex_wake(word);
}

/* Wait until *word == want, at most timeout_ns. 0: equal; 1: timed out. For up to spin_ns first it polls,
 * yielding the core between looks (a waiter that expects the word within microseconds - an acknowledgement, a
 * verdict - skips a sleep and a wake-up; one that would hold a core somebody needs gives it up at each look). */
int avla_wait_eq(int32_t *word, int32_t want, int64_t timeout_ns, int64_t spin_ns) {
    int64_t start = now_ns(), end = start + timeout_ns, spin_end = start + (spin_ns < timeout_ns ? spin_ns : timeout_ns);
    while (now_ns() < spin_end) {
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return 0;
        sched_yield();
    }
    for (;;) {
        int32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (v == want) return 0;
        int64_t left = end - now_ns();
        if (left <= 0) return 1;
        avla_futex_wait(word, v, left);
    }
}

/* Each member has a slot of SLOT bytes in the page; at BELL_TICK a futex word it sleeps on, at BELL_WANT the stream
 * position it waits for (0: not waiting). Waking only the member whose position was reached, and only once per
 * chunk it asked for, keeps the publisher - packing on one core - from being preempted by a herd of waiters. */
#define BELL_TICK 40
#define BELL_WANT 48
#define CHUNK_BYTES (1 << 20)

static void wake_member(uint8_t *slot) {
    __atomic_add_fetch((int32_t *)(slot + BELL_TICK), 1, __ATOMIC_SEQ_CST);
    avla_futex_wake((int32_t *)(slot + BELL_TICK));
}

/* Publisher: `value` bytes of the stream are written (and fenced: the packing kernel's sfence, or ordinary
 * stores). Store it, then wake each of the k member slots (at `slots`, `stride` apart) waiting for no more. */
void avla_progress(int64_t *progress, int64_t value, uint8_t *slots, int64_t stride, int64_t k) {
    __atomic_store_n(progress, value, __ATOMIC_SEQ_CST);
    for (int64_t i = 0; i < k; i++) {
        uint8_t *slot = slots + i * stride;
        int64_t *want = (int64_t *)(slot + BELL_WANT);
        int64_t w = __atomic_load_n(want, __ATOMIC_SEQ_CST);
        if (w > 0 && w <= value && __atomic_compare_exchange_n(want, &w, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            wake_member(slot);
    }
}

/* Publisher: wake every member whatever it waits for (a seal, an abort, a drop). */
void avla_wake_members(uint8_t *slots, int64_t stride, int64_t k) {
    for (int64_t i = 0; i < k; i++) wake_member(slots + i * stride);
}

/* Member: wait until *progress >= want. 0: reached; 1: `until_ns` (CLOCK_MONOTONIC) passed; 2: the post word moved
 * away from post_seen (a new post, an abort or a drop: what we follow is gone). */
static int wait_progress(const int64_t *progress, int64_t want, uint8_t *slot, const int32_t *post,
                         int32_t post_seen, int64_t until_ns) {
    int32_t *tick = (int32_t *)(slot + BELL_TICK);
    int64_t *wanted = (int64_t *)(slot + BELL_WANT);
    for (;;) {
        if (__atomic_load_n(post, __ATOMIC_ACQUIRE) != post_seen) return 2;
        if (__atomic_load_n(progress, __ATOMIC_ACQUIRE) >= want) return 0;
        int64_t left = until_ns - now_ns();
        if (left <= 0) return 1;
        int32_t seen = __atomic_load_n(tick, __ATOMIC_SEQ_CST);
        __atomic_store_n(wanted, want, __ATOMIC_SEQ_CST);
        /* Re-check after saying what we wait for: a progress store before ours is visible now; one after it
         * finds our want and wakes us (moving the tick, so a futex wait on the old value returns at once). */
        if (__atomic_load_n(progress, __ATOMIC_SEQ_CST) < want
                && __atomic_load_n(post, __ATOMIC_SEQ_CST) == post_seen)
            avla_futex_wait(tick, seen, left);
        __atomic_store_n(wanted, 0, __ATOMIC_SEQ_CST);
    }
}

int avla_wait_progress(const int64_t *progress, int64_t want, uint8_t *slot, const int32_t *post,
                       int32_t post_seen, int64_t timeout_ns) {
    return wait_progress(progress, want, slot, post, post_seen, now_ns() + timeout_ns);
}

/* Member: sum tensors *next .. n-1 of its share as the publisher's progress passes the end of each one in the
 * packing stream (ends[i], increasing), reading sizes[i] bytes at base + offs[i]; sums[i] gets avla_sum of them.
 * Each wait is for half of what is left of the share (at least CHUNK_BYTES): a wake-up preempts the packing
 * publisher when the cores are busy (~0.05-0.1 ms each, measured on 2 cores), so a share takes a few wake-ups, not
 * one per tensor, while the last chunk - the only part summed after the packing ends - stays small. Returns 0 when
 * all are summed, 1 when slice_ns ran out first (*next says where to go on), 2 when the post word moved. */
int avla_follow_sum(const uint8_t *base, const int64_t *offs, const int64_t *sizes, const int64_t *ends,
                    int64_t n, int64_t *next, uint64_t *sums, const int64_t *progress, uint8_t *slot,
                    const int32_t *post, int32_t post_seen, int64_t slice_ns) {
    int64_t until = now_ns() + slice_ns;
    for (int64_t i = *next; i < n; i++) {
        if (__atomic_load_n(progress, __ATOMIC_ACQUIRE) < ends[i]) {
            int64_t half = (ends[n - 1] - ends[i]) / 2, j = i;
            int64_t target = ends[i] + (half > CHUNK_BYTES ? half : CHUNK_BYTES);
            while (j + 1 < n && ends[j + 1] <= target) j++;
            int r = wait_progress(progress, ends[j], slot, post, post_seen, until);
            if (r) return r;
        }
        sums[i] = avla_sum(base + offs[i], (size_t)sizes[i]);
        *next = i + 1;
    }
    return 0;
}
