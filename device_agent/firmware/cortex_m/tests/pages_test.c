/* The page store (src/pages.c) on the host, over a RAM flash device: a page reads back as written,
 * and a page whose bytes changed on flash is refused on page-in. `make host-test` builds and runs it;
 * tests/device_agent/firmware/test_firmware_qemu.py runs it too. */
#include "crc32.h"
#include "error.h"
#include "flash.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEVICE_BYTES (64u * 1024u)

static uint8_t device[DEVICE_BYTES];

int flash_dev_open(void) { return 0; }
uint32_t flash_dev_size(void) { return DEVICE_BYTES; }
const char *flash_dev_error(void) { return "ram device"; }
int flash_dev_erase(uint32_t addr, uint32_t bytes)
{
    if (addr > DEVICE_BYTES || bytes > DEVICE_BYTES - addr)
        return -1;
    memset(device + addr, 0xFF, bytes);
    return 0;
}
int flash_dev_write(uint32_t addr, const void *src, uint32_t bytes)
{
    if (addr > DEVICE_BYTES || bytes > DEVICE_BYTES - addr)
        return -1;
    memcpy(device + addr, src, bytes);
    return 0;
}
int flash_dev_read(uint32_t addr, void *dst, uint32_t bytes)
{
    if (addr > DEVICE_BYTES || bytes > DEVICE_BYTES - addr)
        return -1;
    memcpy(dst, device + addr, bytes);
    return 0;
}

static int failures;

static void check(int condition, const char *what)
{
    printf("%s %s\n", condition ? "ok  " : "FAIL", what);
    if (!condition) {
        printf("     last error: %s\n", fw_error_message);
        failures++;
    }
}

int main(void)
{
    static uint8_t page[4096], back[4096];
    for (uint32_t i = 0; i < sizeof page; i++)
        page[i] = (uint8_t)(i * 7u + 3u);

    check(crc32_update(0, "123456789", 9) == 0xCBF43926u, "CRC-32 of \"123456789\" is zlib's 0xcbf43926");

    pages_reset();
    check(page_write(2, page, sizeof page), "page_write node 2");
    check(page_read(2, back, sizeof back) && memcmp(page, back, sizeof page) == 0, "page_read returns the bytes");
    check(!page_write(2, page, sizeof page), "a second page for node 2 is refused");

    uint32_t addr = page_address(2);
    device[addr + PAGE_HEADER_BYTES + 1000u] ^= 0x01u; /* one bit of the data flips on flash */
    check(!page_read(2, back, sizeof back) && strstr(fw_error_message, "CRC-32") != NULL,
          "a flipped data bit is refused on page-in (CRC-32)");
    device[addr + PAGE_HEADER_BYTES + 1000u] ^= 0x01u;
    check(page_read(2, back, sizeof back), "restored, the page reads again");

    device[addr + 4u] ^= 0x04u; /* the header's node field */
    check(!page_read(2, back, sizeof back) && strstr(fw_error_message, "header") != NULL,
          "a corrupt header is refused on page-in");
    device[addr + 4u] ^= 0x04u;

    device[addr + 12u] ^= 0x80u; /* the stored CRC itself */
    check(!page_read(2, back, sizeof back) && strstr(fw_error_message, "CRC-32") != NULL,
          "a corrupt stored CRC is refused on page-in");
    device[addr + 12u] ^= 0x80u;

    check(!page_read(2, back, 100), "reading a page with the wrong length is refused");
    check(!page_read(3, back, sizeof back), "reading a node with no page is refused");

    check(page_write(5, page, 100), "page_write node 5 (a second slot)");
    check(page_address(5) >= addr + PAGE_HEADER_BYTES + sizeof page, "slots do not overlap");
    check(page_free(2) && !page_exists(2), "page_free node 2");
    check(page_write(7, page, 64) && page_address(7) == addr, "the freed slot is reused first-fit");
    check(page_read(5, back, 100) && memcmp(page, back, 100) == 0, "node 5 is intact");

    static uint8_t big[DEVICE_BYTES];
    check(!page_write(9, big, sizeof big) && strstr(fw_error_message, "flash full") != NULL,
          "a page larger than the free flash is refused");

    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
