/*
 * CRC-32 (ISO-HDLC: reflected polynomial 0xEDB88320, the zlib one), the format's per-piece
 * checksum, at memory speed: zlib.crc32's ~1.6 GB/s made checksumming the largest CPU cost of a
 * save or load.  x86-64 CPUs with PCLMULQDQ fold 64 bytes per iteration with carry-less multiplies
 * (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction"); the
 * constants are x^k mod P(x) (bit-reflected) for the fold distances, and P(x)'s Barrett constants.
 * gefen_ckpt.io.native loads it with ctypes and checks it against zlib.crc32 before using it.
 */
#include "native.h"

static uint32_t table[256];
static int table_ready = 0;

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[n] = c;
    }
    table_ready = 1;
}

/* bytewise, on the internal (inverted) register */
static uint32_t crc_bytes(uint32_t c, const uint8_t *p, size_t n) {
    while (n--) c = table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CLMUL __attribute__((target("pclmul,sse4.1")))

/* Fold len bytes (len >= 64, a multiple of 16) into the internal register c. */
static CLMUL uint32_t crc_fold(uint32_t c, const uint8_t *p, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL); /* fold by 512 bits */
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL); /* fold by 128 bits */
    const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124LL);                /* 64 -> 32 bits */
    const __m128i barrett = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL); /* mu, P(x) */
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);

    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 0));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)c));
    p += 64;
    len -= 64;
    while (len >= 64) {
        __m128i a1 = _mm_clmulepi64_si128(x1, k1k2, 0x00), b1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
        __m128i a2 = _mm_clmulepi64_si128(x2, k1k2, 0x00), b2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        __m128i a3 = _mm_clmulepi64_si128(x3, k1k2, 0x00), b3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
        __m128i a4 = _mm_clmulepi64_si128(x4, k1k2, 0x00), b4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(a1, b1), _mm_loadu_si128((const __m128i *)(p + 0)));
        x2 = _mm_xor_si128(_mm_xor_si128(a2, b2), _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(_mm_xor_si128(a3, b3), _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(_mm_xor_si128(a4, b4), _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        len -= 64;
    }
    /* four lanes -> one */
    __m128i a = _mm_clmulepi64_si128(x1, k3k4, 0x00), b = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(a, b), x2);
    a = _mm_clmulepi64_si128(x1, k3k4, 0x00), b = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(a, b), x3);
    a = _mm_clmulepi64_si128(x1, k3k4, 0x00), b = _mm_clmulepi64_si128(x1, k3k4, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(a, b), x4);
    while (len >= 16) {
        a = _mm_clmulepi64_si128(x1, k3k4, 0x00), b = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(a, b), _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    /* 128 -> 64 -> 32 bits, then Barrett reduction */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00), x2);
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), barrett, 0x10);
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, low32), barrett, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static int has_clmul(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}
#else
static uint32_t crc_fold(uint32_t c, const uint8_t *p, size_t len) { return crc_bytes(c, p, len); }
static int has_clmul(void) { return 0; }
#endif

/* 1 when the carry-less multiply path is available (else this library is no faster than zlib). */
NATIVE_EXPORT int gefen_crc32_accelerated(void) { return has_clmul(); }

/* zlib.crc32(data, value): extend the running checksum ``crc`` (start from 0) with n bytes. */
NATIVE_EXPORT uint32_t gefen_crc32(uint32_t crc, const void *data, size_t n) {
    const uint8_t *p = data;
    if (!table_ready) make_table();
    uint32_t c = ~crc;
    if (n >= 64 && has_clmul()) {
        size_t bulk = n & ~(size_t)15;
        c = crc_fold(c, p, bulk);
        p += bulk;
        n -= bulk;
    }
    return ~crc_bytes(c, p, n);
}

/* crcs[i] = CRC-32 of sizes[i] bytes at addrs[i]: many pieces already in memory (a mapped file)
 * in one call, without the GIL. */
NATIVE_EXPORT void gefen_crc32_many(int64_t n, const void *const *addrs, const int64_t *sizes, uint32_t *crcs) {
    for (int64_t i = 0; i < n; i++) crcs[i] = gefen_crc32(0, addrs[i], (size_t)sizes[i]);
}
