/* The C library gefen_ckpt._native: crc32.c (the checksum) and file_io.c (the I/O loops that
 * run without the GIL).  Plain C, no Python C-API: gefen_ckpt/native.py binds it with ctypes. */
#ifndef GEFEN_CKPT_NATIVE_H
#define GEFEN_CKPT_NATIVE_H
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define NATIVE_EXPORT __declspec(dllexport)
#else
#define NATIVE_EXPORT __attribute__((visibility("default")))
#endif

/* zlib.crc32(data, value): extend the running checksum ``crc`` (start from 0) with n bytes. */
NATIVE_EXPORT uint32_t gefen_crc32(uint32_t crc, const void *data, size_t n);
#endif
