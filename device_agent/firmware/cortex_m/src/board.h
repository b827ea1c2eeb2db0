/* What a board provides to the portable firmware (src/). One board file implements it:
 * boards/mps2_an386.c for QEMU's mps2-an386; a real board is a new boards/<name>.c + .ld. */
#ifndef POET_BOARD_H
#define POET_BOARD_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    const char *name;          /* McuBoardInfo.board, e.g. "mps2-an386" */
    const char *platform;      /* the platform profile it is priced on, e.g. "m4" */
    bool emulated;             /* true under an emulator: ticks are not a real board's timing */
    uint8_t *arena;            /* the static activation arena (the schedule's controlled RAM) */
    uint32_t arena_bytes;
    uint8_t *params;           /* weights, weight gradients and momentum */
    uint32_t param_bytes;
    uint8_t *batch;            /* the training batch: inputs, then labels (outside the arena) */
    uint32_t batch_bytes;
    uint32_t flash_bytes;      /* room for pages (see flash.h) */
    uint64_t tick_hz;          /* the unit of board_ticks() */
} board_config_t;

extern const board_config_t board_config;

void board_init(void);               /* clocks, UART, tick counter, flash device */
uint64_t board_ticks(void);          /* monotonic, in 1/tick_hz seconds */
int board_uart_getc(void);           /* the next received byte, or -1 when none is waiting */
void board_uart_putc(uint8_t byte);  /* blocks until the byte is queued */
void board_idle(void);               /* nothing received: may sleep until an interrupt */
uint32_t board_entropy(void);        /* varies between boots; seeds the link's session id */
void board_log(const char *line);    /* a debug line (never on the link's UART) */

#endif
