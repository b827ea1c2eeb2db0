/* Flash as one semihosted file, FLASH_FILE in the emulator's working directory (the flash dir):
 * the device's address is the file offset. Created empty at boot; never larger than the board's
 * flash_bytes. A real board replaces this file with its flash driver (flash.h). */
#include "board.h"
#include "flash.h"
#include "semihost.h"

#include <stdio.h>

#define FLASH_FILE "poet_flash.bin"

static int32_t handle = -1;
static char reason[96];

static int refuse(const char *what, uint32_t addr, uint32_t bytes)
{
    snprintf(reason, sizeof reason, "%s " FLASH_FILE " [0x%08lx, +%lu)", what, (unsigned long)addr,
             (unsigned long)bytes);
    return -1;
}

int flash_dev_open(void)
{
    handle = semihost_open(FLASH_FILE, SH_MODE_WPLUS_B);
    if (handle < 0) {
        snprintf(reason, sizeof reason, "cannot create " FLASH_FILE " in the emulator's working directory");
        return -1;
    }
    return 0;
}

uint32_t flash_dev_size(void) { return board_config.flash_bytes; }
const char *flash_dev_error(void) { return reason; }

static int check(const char *what, uint32_t addr, uint32_t bytes)
{
    if (handle < 0)
        return refuse("no flash file for", addr, bytes);
    if (addr > board_config.flash_bytes || bytes > board_config.flash_bytes - addr)
        return refuse("out of range:", addr, bytes);
    if (semihost_seek(handle, addr) != 0)
        return refuse(what, addr, bytes);
    return 0;
}

int flash_dev_erase(uint32_t addr, uint32_t bytes)
{
    return check("cannot erase", addr, bytes);  /* a file needs no erase before writing */
}

int flash_dev_write(uint32_t addr, const void *src, uint32_t bytes)
{
    if (check("cannot seek to write", addr, bytes) != 0)
        return -1;
    return semihost_write(handle, src, bytes) == 0 ? 0 : refuse("short write to", addr, bytes);
}

int flash_dev_read(uint32_t addr, void *dst, uint32_t bytes)
{
    if (check("cannot seek to read", addr, bytes) != 0)
        return -1;
    return semihost_read(handle, dst, bytes) == 0 ? 0 : refuse("short read from", addr, bytes);
}
