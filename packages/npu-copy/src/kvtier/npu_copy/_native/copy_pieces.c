/* kvtier-npu-copy: many host memory pieces copied in one call, without the GIL.
 *
 * The CPU backend moves a transfer as (block x segment) pieces. Calling memmove
 * from Python once per piece costs a GIL round trip each, and a plain memcpy of
 * a few tens of KiB uses cached stores, which read every destination line before
 * writing it and leave the hardware prefetcher to restart at every piece. Here one
 * call copies a range of pieces; with `stream` set it writes with non-temporal
 * stores and prefetches the head of the next piece's source while copying the
 * current one, which is what a large memcpy does for one contiguous region.
 *
 * Compiled into the platform wheels (hatch_build.py) and, for source installs, at
 * run time by kvtier.npu_copy.native with the system C compiler; when no
 * compiler is available the backend keeps its pure-Python path.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KVTIER_X86 1
#else
#define KVTIER_X86 0
#endif

#define PREFETCH_BYTES 4096

static void copy_piece(char *dst, const char *src, size_t n, const char *next, int stream)
{
#if KVTIER_X86
    if (stream && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t i = 0, pf = 0;
        for (; i + 64 <= n; i += 64) {
            if (next != NULL && pf < PREFETCH_BYTES) {
                _mm_prefetch(next + pf, _MM_HINT_T0);
                pf += 64;
            }
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#else
    (void)next;
    (void)stream;
#endif
    memmove(dst, src, n);
}

/* Pieces are numbered segment-major: piece p is block p % nblocks of segment
 * p / nblocks. Segment s's block b lives at base[s] + ids[b] * stride[s] on each
 * side and is size[s] bytes long. Copies pieces [start, end). */
void kvtier_copy_pieces(const uint64_t *dst_base, const int64_t *dst_stride,
                        const int64_t *dst_ids, const uint64_t *src_base,
                        const int64_t *src_stride, const int64_t *src_ids,
                        const uint64_t *size, int64_t nblocks, int64_t start, int64_t end,
                        int stream)
{
    for (int64_t p = start; p < end; ++p) {
        int64_t s = p / nblocks, b = p % nblocks;
        char *dst = (char *)(uintptr_t)(dst_base[s] + (uint64_t)(dst_ids[b] * dst_stride[s]));
        const char *src =
            (const char *)(uintptr_t)(src_base[s] + (uint64_t)(src_ids[b] * src_stride[s]));
        const char *next = NULL;
        if (p + 1 < end) {
            int64_t s2 = (p + 1) / nblocks, b2 = (p + 1) % nblocks;
            next = (const char *)(uintptr_t)(src_base[s2] +
                                             (uint64_t)(src_ids[b2] * src_stride[s2]));
        }
        copy_piece(dst, src, (size_t)size[s], next, stream);
    }
#if KVTIER_X86
    if (stream)
        _mm_sfence(); /* streamed stores are visible before the caller signals completion */
#endif
}

int kvtier_copy_abi_version(void) { return 1; }
