/* The activation arena (src/arena.c) on the host: declared-byte accounting, the high-water mark,
 * refusal when full, and compaction that keeps every owner's data and pointer right. */
#include "arena.h"
#include "error.h"

#include <stdio.h>
#include <string.h>

static int failures;

static void check(int condition, const char *what)
{
    printf("%s %s\n", condition ? "ok  " : "FAIL", what);
    if (!condition) {
        printf("     last error: %s\n", fw_error_message);
        failures++;
    }
}

static bool filled_with(const void *p, uint8_t value, uint32_t n)
{
    const uint8_t *b = p;
    for (uint32_t i = 0; i < n; i++)
        if (b[i] != value)
            return false;
    return true;
}

int main(void)
{
    static uint8_t memory[1000];
    void *a, *b, *c, *d, *e, *zero;
    arena_init(memory, sizeof memory);

    check(arena_alloc(300, &a) && arena_alloc(300, &b) && arena_alloc(300, &c), "three blocks of 300 bytes");
    check(arena_in_use() == 900 && arena_high_water() == 900, "in use and high-water count declared bytes");
    memset(a, 0xA1, 300);
    memset(b, 0xB2, 300);
    memset(c, 0xC3, 300);
    check(!arena_alloc(200, &d) && d == NULL && strstr(fw_error_message, "arena full") != NULL,
          "200 more bytes do not fit 1000: refused");
    check(arena_alloc(0, &zero) && zero == NULL && arena_in_use() == 900, "a zero-byte block holds nothing");

    arena_free(&a);
    arena_free(&c);
    check(a == NULL && arena_in_use() == 300, "freeing clears the owner and the count");
    /* free: [0, 300) and [600, 1000); 500 bytes fit in neither hole */
    check(arena_alloc(500, &d), "500 bytes fit after compaction");
    check(arena_compactions() == 1, "one compaction");
    check(b == memory && filled_with(b, 0xB2, 300), "the surviving block moved to the start with its bytes");
    check((uint8_t *)d == memory + 300, "the new block follows it");
    check(arena_high_water() == 900 && arena_in_use() == 800, "high-water stays at the peak");
    check(arena_alloc(200, &e) && arena_in_use() == 1000 && arena_high_water() == 1000, "exactly full");
    check(!arena_alloc(1, &a), "not one byte more");

    arena_reset();
    check(arena_in_use() == 0 && b == NULL && d == NULL && e == NULL && arena_high_water() == 1000,
          "reset drops every block and keeps the high-water mark");
    arena_reset_high_water();
    check(arena_high_water() == 0, "until it is reset");
    check(arena_alloc(6, &a) && arena_alloc(4, &b) && (uint8_t *)b - (uint8_t *)a == 8,
          "blocks start 4-byte aligned (6 declared bytes take 8)");

    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
