#include "error.h"

#include <stdarg.h>
#include <stdio.h>

char fw_error_message[FW_ERROR_MAX];

bool fail(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    vsnprintf(fw_error_message, sizeof fw_error_message, format, args);
    va_end(args);
    return false;
}
