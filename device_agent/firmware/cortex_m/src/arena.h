/* The static activation arena: one block per RAM copy, sized exactly as the schedule declares.
 * In-use and high-water figures count declared bytes (the schedule's output_bytes). When no hole
 * is large enough but the declared total fits, the blocks are slid together (compaction) and the
 * owners' pointers updated, so a schedule that fits its budget never fails on fragmentation. */
#ifndef POET_ARENA_H
#define POET_ARENA_H

#include <stdbool.h>
#include <stdint.h>

#define ARENA_MAX_BLOCKS 64u

void arena_init(uint8_t *base, uint32_t bytes);
void arena_reset(void);                          /* drop every block; the high-water mark stays */
/* Reserve `bytes` and store its address in *owner (which compaction keeps up to date). A zero-byte
 * block holds no memory: *owner is NULL. Fails (fw_error) when the arena has no room. */
bool arena_alloc(uint32_t bytes, void **owner);
void arena_free(void **owner);
uint32_t arena_in_use(void);
uint32_t arena_high_water(void);
void arena_reset_high_water(void);
uint32_t arena_compactions(void);
uint32_t arena_capacity(void);

#endif
