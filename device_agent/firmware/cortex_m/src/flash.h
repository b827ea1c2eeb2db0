/* Flash: the raw device a board provides, and the page store above it (pages.c).
 *
 * The device is byte-addressed storage of flash_dev_size() bytes. A board implements it with
 * whatever it has: a semihosted file on QEMU (flash_semihost.c), a SPI NOR or SD driver on a
 * real board. flash_dev_erase() prepares a range for writing (NOR needs it; a file does not).
 * Each returns 0 on success, or -1 and leaves a reason in flash_dev_error(). */
#ifndef POET_FLASH_H
#define POET_FLASH_H

#include <stdbool.h>
#include <stdint.h>

int flash_dev_open(void);
uint32_t flash_dev_size(void);
int flash_dev_erase(uint32_t addr, uint32_t bytes);
int flash_dev_write(uint32_t addr, const void *src, uint32_t bytes);
int flash_dev_read(uint32_t addr, void *dst, uint32_t bytes);
const char *flash_dev_error(void);

/* Pages: one per node, each a header (magic, node, length, CRC-32 of node+length+data) and the
 * data, at a slot the store allocates first-fit in the device. page_read() checks the header and
 * the CRC and refuses a page that does not match. Errors go to fw_error (error.h). */
#define PAGES_MAX 64u
#define PAGE_HEADER_BYTES 16u
#define PAGE_ALIGN 256u  /* slots start on a NOR program-page boundary */

void pages_reset(void);                  /* forget every page (the device is not erased) */
bool page_write(uint32_t node, const void *data, uint32_t bytes);
bool page_read(uint32_t node, void *dst, uint32_t bytes);
bool page_free(uint32_t node);
bool page_exists(uint32_t node);
uint32_t page_address(uint32_t node);    /* device address of the page's header (tests) */
uint32_t pages_bytes_in_use(void);       /* slot bytes, header and alignment included */

#endif
