/* Copy with non-temporal stores, summing the source as it streams by (async_vla/weights/native/__init__.py).
 *
 * Why: packing a version into the shared-memory segment is one pass over every weight byte. glibc's memcpy
 * switches to non-temporal stores only above ~3/4 of the shared cache (190 MB on our hosts), so per-tensor
 * copies run through the cache at about half of memcpy's large-copy bandwidth, and the checksum then needs a
 * second pass. Here both happen in one pass: each 16-byte block is loaded once, added into two 64-bit lanes
 * and streamed to the destination (which other processes read next; keeping it in our cache gains nothing).
 *
 * The sum is the one `async_vla.weights.buckets.tensor_sum` defines: the wrap-around sum of the bytes as
 * little-endian 8-byte words counted from the start, plus each trailing byte (< 8 of them) as a value.
 * Built by bin/_setup.sh (`cc -O2 -shared -fPIC`); without it the packer falls back to torch.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define AVLA_SSE2 1
#endif

#define AVLA_ABI_VERSION 2

int avla_abi_version(void) { return AVLA_ABI_VERSION; }

static uint64_t sum_tail(const unsigned char *s, size_t n) {
    uint64_t total = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        total += w;
    }
    for (; i < n; i++) total += s[i];
    return total;
}

/* Sum of the bytes as 8-byte words (+ trailing bytes), without copying. */
uint64_t avla_sum(const void *src, size_t n) {
    const unsigned char *s = (const unsigned char *)src;
#ifdef AVLA_SSE2
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm_add_epi64(a0, _mm_loadu_si128((const __m128i *)(s + i)));
        a1 = _mm_add_epi64(a1, _mm_loadu_si128((const __m128i *)(s + i + 16)));
        a2 = _mm_add_epi64(a2, _mm_loadu_si128((const __m128i *)(s + i + 32)));
        a3 = _mm_add_epi64(a3, _mm_loadu_si128((const __m128i *)(s + i + 48)));
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3)));
    return lanes[0] + lanes[1] + sum_tail(s + i, n - i);
#else
    return sum_tail(s, n);
#endif
}

/* Copy n bytes src -> dst (not overlapping) and return avla_sum(src, n). Non-temporal stores when dst is
 * 16-byte aligned (our buckets are 64-byte aligned), ordered by a store fence before returning, so a later
 * ordinary store (the segment's control word) cannot become visible before the data. */
uint64_t avla_copy_sum(void *dst, const void *src, size_t n) {
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
#ifdef AVLA_SSE2
    if (((uintptr_t)d & 15) == 0 && n >= 256) {
        __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i x1 = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i x3 = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), x0);
            _mm_stream_si128((__m128i *)(d + i + 16), x1);
            _mm_stream_si128((__m128i *)(d + i + 32), x2);
            _mm_stream_si128((__m128i *)(d + i + 48), x3);
            a0 = _mm_add_epi64(a0, x0);
            a1 = _mm_add_epi64(a1, x1);
            a2 = _mm_add_epi64(a2, x2);
            a3 = _mm_add_epi64(a3, x3);
        }
        _mm_sfence();
        memcpy(d + i, s + i, n - i);
        uint64_t lanes[2];
        _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3)));
        return lanes[0] + lanes[1] + sum_tail(s + i, n - i);
    }
#endif
    memcpy(d, s, n);
    return sum_tail(s, n);
}
