#include "semihost.h"

#include <string.h>

int32_t semihost_open(const char *path, uint32_t mode)
{
    uint32_t args[3] = {(uint32_t)path, mode, (uint32_t)strlen(path)};
    return semihost_call(SH_SYS_OPEN, args);
}

int32_t semihost_close(int32_t handle)
{
    uint32_t args[1] = {(uint32_t)handle};
    return semihost_call(SH_SYS_CLOSE, args);
}

int32_t semihost_write(int32_t handle, const void *data, uint32_t bytes)
{
    uint32_t args[3] = {(uint32_t)handle, (uint32_t)data, bytes};
    return semihost_call(SH_SYS_WRITE, args);
}

int32_t semihost_read(int32_t handle, void *data, uint32_t bytes)
{
    uint32_t args[3] = {(uint32_t)handle, (uint32_t)data, bytes};
    return semihost_call(SH_SYS_READ, args);
}

int32_t semihost_seek(int32_t handle, uint32_t position)
{
    uint32_t args[2] = {(uint32_t)handle, position};
    return semihost_call(SH_SYS_SEEK, args);
}

void semihost_exit(uint32_t reason)
{
    /* AArch32: r1 is the ADP_Stopped_* reason itself; QEMU exits 0 for ApplicationExit, else 1. */
    for (;;)
        semihost_call(SH_SYS_EXIT, (const void *)(uintptr_t)reason);
}
