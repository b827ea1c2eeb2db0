#ifndef POET_ERROR_H
#define POET_ERROR_H

#include <stdbool.h>

#define FW_ERROR_MAX 192u  /* McuError.message max_size (mcu.options) */

extern char fw_error_message[FW_ERROR_MAX];

/* Record why something failed (printf format); returns false so callers can `return fail(...)`. */
bool fail(const char *format, ...) __attribute__((format(printf, 1, 2)));

#endif
