/* What the C sources of gefen._gefen_step share: the export attribute, the dtype codes that
 * gefen.native passes (gefen.native._DT) and exact bf16 widening. */
#ifndef GEFEN_COMMON_H
#define GEFEN_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(_WIN32)
#define GEFEN_EXPORT __declspec(dllexport)
#else
#define GEFEN_EXPORT __attribute__((visibility("default")))
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* element i of an fp32 or bf16 array, as fp32 (exact) */
static inline float ld_g(const void *g, int dt, int64_t i) {
    return dt == DT_F32 ? ((const float *)g)[i] : bf16_to_f32(((const uint16_t *)g)[i]);
}

#endif
