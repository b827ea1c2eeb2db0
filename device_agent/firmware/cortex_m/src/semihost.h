/* ARM semihosting (bkpt 0xAB): the debugger or emulator serves these calls. Used by the
 * semihosted flash (flash_semihost.c) and debug logs; a real board without a debugger has none. */
#ifndef POET_SEMIHOST_H
#define POET_SEMIHOST_H

#include <stdint.h>

enum {
    SH_SYS_OPEN = 0x01, SH_SYS_CLOSE = 0x02, SH_SYS_WRITE = 0x05, SH_SYS_READ = 0x06, SH_SYS_SEEK = 0x0A,
    SH_SYS_FLEN = 0x0C, SH_SYS_CLOCK = 0x10, SH_SYS_TIME = 0x11, SH_SYS_EXIT = 0x18, SH_SYS_ELAPSED = 0x30,
};
enum { SH_MODE_RB = 1, SH_MODE_WPLUS_B = 7, SH_MODE_A = 8 };

static inline int32_t semihost_call(uint32_t op, const void *arg)
{
    register uint32_t r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
    return (int32_t)r0;
}

int32_t semihost_open(const char *path, uint32_t mode);
int32_t semihost_close(int32_t handle);
/* Both return the number of bytes NOT transferred (0 on success), as semihosting does. */
int32_t semihost_write(int32_t handle, const void *data, uint32_t bytes);
int32_t semihost_read(int32_t handle, void *data, uint32_t bytes);
int32_t semihost_seek(int32_t handle, uint32_t position);
void semihost_exit(uint32_t reason) __attribute__((noreturn));

#endif
