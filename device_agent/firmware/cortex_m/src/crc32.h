#ifndef POET_CRC32_H
#define POET_CRC32_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32 IEEE 802.3 as zlib.crc32: crc32_update(0, data, n) == zlib.crc32(data). */
uint32_t crc32_update(uint32_t crc, const void *data, size_t bytes);

#endif
