/* The page store over the raw flash device (flash.h): one CRC-checked page per node. */
#include "crc32.h"
#include "error.h"
#include "flash.h"

#include <string.h>

#define PAGE_MAGIC 0x50474550u /* "PEGP" little-endian */

typedef struct {
    bool used;
    uint32_t addr;   /* header address */
    uint32_t slot;   /* bytes reserved: header + data, rounded up to PAGE_ALIGN */
    uint32_t bytes;  /* data bytes */
} slot_t;

static slot_t slots[PAGES_MAX];

static uint32_t round_up(uint32_t n, uint32_t to) { return (n + to - 1u) / to * to; }

static uint32_t page_crc(uint32_t node, uint32_t bytes, const void *data)
{
    uint32_t head[2] = {node, bytes};
    return crc32_update(crc32_update(0, head, sizeof head), data, bytes);
}

void pages_reset(void) { memset(slots, 0, sizeof slots); }

bool page_exists(uint32_t node) { return node < PAGES_MAX && slots[node].used; }

uint32_t page_address(uint32_t node) { return page_exists(node) ? slots[node].addr : UINT32_MAX; }

uint32_t pages_bytes_in_use(void)
{
    uint32_t total = 0;
    for (uint32_t i = 0; i < PAGES_MAX; i++)
        if (slots[i].used)
            total += slots[i].slot;
    return total;
}

/* The lowest address where `size` bytes overlap no slot in use (first fit), or UINT32_MAX. */
static uint32_t find_room(uint32_t size)
{
    uint32_t candidate = 0;
    for (;;) {
        bool moved = false;
        for (uint32_t i = 0; i < PAGES_MAX; i++) {
            const slot_t *s = &slots[i];
            if (s->used && s->addr < candidate + size && candidate < s->addr + s->slot) {
                candidate = s->addr + s->slot;
                moved = true;
            }
        }
        if (!moved)
            break;
    }
    uint32_t capacity = flash_dev_size();
    return (candidate <= capacity && size <= capacity - candidate) ? candidate : UINT32_MAX;
}

bool page_write(uint32_t node, const void *data, uint32_t bytes)
{
    if (node >= PAGES_MAX)
        return fail("node %lu is beyond the page store's %u pages", (unsigned long)node, PAGES_MAX);
    if (slots[node].used)
        return fail("node %lu already has a page on flash", (unsigned long)node);
    if (bytes > UINT32_MAX - PAGE_HEADER_BYTES - PAGE_ALIGN)
        return fail("a page of %lu bytes is too large", (unsigned long)bytes);
    uint32_t size = round_up(PAGE_HEADER_BYTES + bytes, PAGE_ALIGN);
    uint32_t addr = find_room(size);
    if (addr == UINT32_MAX)
        return fail("flash full: no room for a page of %lu bytes (%lu of %lu bytes in use)", (unsigned long)bytes,
                    (unsigned long)pages_bytes_in_use(), (unsigned long)flash_dev_size());
    uint32_t header[4] = {PAGE_MAGIC, node, bytes, page_crc(node, bytes, data)};
    if (flash_dev_erase(addr, size) != 0 || flash_dev_write(addr, header, sizeof header) != 0 ||
        (bytes && flash_dev_write(addr + PAGE_HEADER_BYTES, data, bytes) != 0))
        return fail("flash write at 0x%08lx failed: %s", (unsigned long)addr, flash_dev_error());
    slots[node] = (slot_t){.used = true, .addr = addr, .slot = size, .bytes = bytes};
    return true;
}

bool page_read(uint32_t node, void *dst, uint32_t bytes)
{
    if (!page_exists(node))
        return fail("node %lu has no page on flash", (unsigned long)node);
    const slot_t *s = &slots[node];
    if (bytes != s->bytes)
        return fail("page of node %lu holds %lu bytes, %lu asked", (unsigned long)node, (unsigned long)s->bytes,
                    (unsigned long)bytes);
    uint32_t header[4];
    if (flash_dev_read(s->addr, header, sizeof header) != 0 ||
        (bytes && flash_dev_read(s->addr + PAGE_HEADER_BYTES, dst, bytes) != 0))
        return fail("flash read at 0x%08lx failed: %s", (unsigned long)s->addr, flash_dev_error());
    if (header[0] != PAGE_MAGIC || header[1] != node || header[2] != bytes)
        return fail("page of node %lu at flash 0x%08lx has a corrupt header", (unsigned long)node,
                    (unsigned long)s->addr);
    uint32_t crc = page_crc(node, bytes, dst);
    if (crc != header[3])
        return fail("page of node %lu at flash 0x%08lx fails its CRC-32 (stored 0x%08lx, read 0x%08lx)",
                    (unsigned long)node, (unsigned long)s->addr, (unsigned long)header[3], (unsigned long)crc);
    return true;
}

bool page_free(uint32_t node)
{
    if (!page_exists(node))
        return fail("node %lu has no page on flash", (unsigned long)node);
    slots[node].used = false;
    return true;
}
