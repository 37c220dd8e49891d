/* gefen_ckpt._native (crc32.c, file_io.c): plain C, bound by gefen_ckpt/io/native.py with ctypes. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#if defined(_WIN32)
#define NATIVE_EXPORT __declspec(dllexport)
#else
#define NATIVE_EXPORT __attribute__((visibility("default")))
#endif
NATIVE_EXPORT uint32_t gefen_crc32(uint32_t crc, const void *data, size_t n); /* zlib.crc32(data, crc) */
