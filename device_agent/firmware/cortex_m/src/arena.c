#include "arena.h"

#include "error.h"

#include <string.h>

typedef struct {
    uint32_t offset;
    uint32_t size;     /* bytes taken in the arena: declared, rounded up to 4 */
    uint32_t declared;
    void **owner;
} block_t;

static uint8_t *arena_base;
static uint32_t arena_bytes;
static block_t blocks[ARENA_MAX_BLOCKS];  /* sorted by offset */
static uint32_t block_count;
static uint32_t in_use, high_water, compactions;

void arena_init(uint8_t *base, uint32_t bytes)
{
    arena_base = base;
    arena_bytes = bytes;
    block_count = 0;
    in_use = high_water = compactions = 0;
}

void arena_reset(void)
{
    for (uint32_t i = 0; i < block_count; i++)
        *blocks[i].owner = NULL;
    block_count = 0;
    in_use = 0;
}

uint32_t arena_in_use(void) { return in_use; }
uint32_t arena_high_water(void) { return high_water; }
void arena_reset_high_water(void) { high_water = in_use; }
uint32_t arena_compactions(void) { return compactions; }
uint32_t arena_capacity(void) { return arena_bytes; }

static uint32_t taken(void)
{
    uint32_t total = 0;
    for (uint32_t i = 0; i < block_count; i++)
        total += blocks[i].size;
    return total;
}

static void compact(void)
{
    uint32_t cursor = 0;
    for (uint32_t i = 0; i < block_count; i++) {
        if (blocks[i].offset != cursor) {
            memmove(arena_base + cursor, arena_base + blocks[i].offset, blocks[i].size);
            blocks[i].offset = cursor;
            *blocks[i].owner = arena_base + cursor;
        }
        cursor += blocks[i].size;
    }
    compactions++;
}

/* Index where a block of `size` fits (first fit) and its offset, or -1. */
static int find_hole(uint32_t size, uint32_t *offset)
{
    uint32_t cursor = 0;
    for (uint32_t i = 0; i <= block_count; i++) {
        uint32_t end = i < block_count ? blocks[i].offset : arena_bytes;
        if (end - cursor >= size) {
            *offset = cursor;
            return (int)i;
        }
        if (i < block_count)
            cursor = blocks[i].offset + blocks[i].size;
    }
    return -1;
}

bool arena_alloc(uint32_t bytes, void **owner)
{
    *owner = NULL;
    if (bytes == 0)
        return true;
    if (bytes > arena_bytes - 3u)
        return fail("%lu bytes do not fit the %lu-byte arena", (unsigned long)bytes, (unsigned long)arena_bytes);
    uint32_t size = (bytes + 3u) & ~3u;
    if (block_count == ARENA_MAX_BLOCKS)
        return fail("arena holds %u blocks already", ARENA_MAX_BLOCKS);
    if (taken() + size > arena_bytes)
        return fail("arena full: %lu bytes asked, %lu of %lu in use", (unsigned long)bytes, (unsigned long)in_use,
                    (unsigned long)arena_bytes);
    uint32_t offset;
    int at = find_hole(size, &offset);
    if (at < 0) {
        compact();
        at = find_hole(size, &offset);
        if (at < 0)
            return fail("arena: no hole of %lu bytes after compaction", (unsigned long)size);
    }
    memmove(&blocks[at + 1], &blocks[at], (block_count - (uint32_t)at) * sizeof blocks[0]);
    blocks[at] = (block_t){.offset = offset, .size = size, .declared = bytes, .owner = owner};
    block_count++;
    *owner = arena_base + offset;
    in_use += bytes;
    if (in_use > high_water)
        high_water = in_use;
    return true;
}

void arena_free(void **owner)
{
    for (uint32_t i = 0; i < block_count; i++) {
        if (blocks[i].owner == owner) {
            in_use -= blocks[i].declared;
            memmove(&blocks[i], &blocks[i + 1], (block_count - i - 1) * sizeof blocks[0]);
            block_count--;
            break;
        }
    }
    *owner = NULL;
}
