/* Board file: QEMU's mps2-an386 (Arm MPS2 FPGA image AN386, a Cortex-M4 with FPU at 25 MHz).
 *
 * Memory (mps2_an386.ld): code and read-only data in ZBT SSRAM1 at 0x00000000 (4 MiB), everything
 * writable in ZBT SSRAM2/3 at 0x20000000 (4 MiB): .data/.bss, the activation arena, the param
 * region, the batch region, the heap and the stack. UART0 (CMSDK APB UART at 0x40004000, QEMU's
 * serial0) carries the link; SysTick counts core cycles (its 24 bits extended by a wrap counter); flash and debug logs are semihosted.
 *
 * A real board is a new file like this one plus its linker script: its sizes, its UART, its tick
 * counter and a flash driver for flash.h in place of flash_semihost.c. */
#include "board.h"
#include "semihost.h"

#include <string.h>

#define CORE_HZ 25000000u
#define ARENA_BYTES (256u * 1024u)  /* the schedule's controlled RAM */
#define PARAM_BYTES (512u * 1024u)  /* weights + weight gradients + momentum */
#define BATCH_BYTES (128u * 1024u)  /* inputs + labels of one batch */
#define FLASH_BYTES (8u * 1024u * 1024u)
#define LOG_FILE "poet_fw.log"

static uint8_t arena[ARENA_BYTES] __attribute__((section(".arena"), aligned(8)));
static uint8_t params[PARAM_BYTES] __attribute__((section(".params"), aligned(8)));
static uint8_t batch[BATCH_BYTES] __attribute__((section(".batch"), aligned(8)));

const board_config_t board_config = {
    .name = "mps2-an386",
    .platform = "m4",
    .emulated = true,
    .arena = arena,
    .arena_bytes = ARENA_BYTES,
    .params = params,
    .param_bytes = PARAM_BYTES,
    .batch = batch,
    .batch_bytes = BATCH_BYTES,
    .flash_bytes = FLASH_BYTES,
    .tick_hz = CORE_HZ,
};

#define REG(addr) (*(volatile uint32_t *)(addr))

/* CMSDK APB UART0 */
#define UART0_DATA REG(0x40004000u)
#define UART0_STATE REG(0x40004004u)
#define UART0_CTRL REG(0x40004008u)
#define UART0_BAUDDIV REG(0x40004010u)
#define UART_STATE_TX_FULL 1u
#define UART_STATE_RX_FULL 2u
#define UART_CTRL_TX_EN 1u
#define UART_CTRL_RX_EN 2u

/* System control space */
#define SYST_CSR REG(0xE000E010u)
#define SYST_RVR REG(0xE000E014u)
#define SYST_CVR REG(0xE000E018u)
#define SCB_ICSR REG(0xE000ED04u)
#define SCB_CPACR REG(0xE000ED88u)
#define SCB_CFSR REG(0xE000ED28u)
#define ICSR_PENDSTSET (1u << 26)
#define SYST_PERIOD (1u << 24) /* the full 24-bit counter; wraps are counted by the interrupt */
#define SYST_RELOAD (SYST_PERIOD - 1u)

static volatile uint32_t systick_wraps;

void SysTick_Handler(void) { systick_wraps++; }

uint64_t board_ticks(void)
{
    static uint64_t last;
    uint32_t high, value, pending;
    do {
        high = systick_wraps;
        value = SYST_CVR;
        pending = SCB_ICSR & ICSR_PENDSTSET;
    } while (high != systick_wraps);
    /* The counter reloaded but its interrupt is not taken yet: that wrap counts already. */
    if (pending && value > SYST_RELOAD / 2u)
        high++;
    uint64_t now = (uint64_t)high * SYST_PERIOD + (SYST_RELOAD - value);
    if (now < last)
        now = last;
    last = now;
    return now;
}

/* Waiting for a byte. A real board would sleep here (WFI, woken by its UART's RX interrupt); under
 * QEMU a halted core wakes so slowly that every received byte took ~10 times longer, so it polls. */
void board_idle(void) {}

int board_uart_getc(void)
{
    if (!(UART0_STATE & UART_STATE_RX_FULL))
        return -1;
    return (int)(UART0_DATA & 0xFFu);
}

void board_uart_putc(uint8_t byte)
{
    while (UART0_STATE & UART_STATE_TX_FULL)
        ;
    UART0_DATA = byte;
}

static uint32_t mix(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

uint32_t board_entropy(void)
{
    uint32_t elapsed[2] = {0, 0};
    semihost_call(SH_SYS_ELAPSED, elapsed);  /* host clock since the emulator started */
    uint32_t h = mix((uint32_t)semihost_call(SH_SYS_TIME, 0));
    h = mix(h ^ (uint32_t)semihost_call(SH_SYS_CLOCK, 0));
    h = mix(h ^ elapsed[0]);
    h = mix(h ^ elapsed[1]);
    h = mix(h ^ SYST_CVR);
    return h ? h : 0x9E3779B9u;
}

void board_log(const char *line)
{
    static int32_t handle = -2;
    if (handle == -2)
        handle = semihost_open(LOG_FILE, SH_MODE_A);
    if (handle < 0)
        return;
    semihost_write(handle, line, (uint32_t)strlen(line));
    semihost_write(handle, "\n", 1);
}

void board_init(void)
{
    UART0_BAUDDIV = CORE_HZ / 115200u;
    UART0_CTRL = UART_CTRL_TX_EN | UART_CTRL_RX_EN;
    systick_wraps = 0;
    SYST_RVR = SYST_RELOAD;
    SYST_CVR = 0;
    SYST_CSR = 7u; /* processor clock, interrupt on wrap, enabled */
}

/* ---- start-up ---- */

extern uint32_t __data_load, __data_start, __data_end, __bss_start, __bss_end, __stack_top;
extern int main(void);

static void fault(const char *what)
{
    char line[64] = "fault: ";
    strncat(line, what, sizeof line - 8u);
    board_log(line);
    semihost_exit(0x20023u); /* ADP_Stopped_RunTimeErrorUnknown: QEMU exits with status 1 */
}

void HardFault_Handler(void) { fault("hard fault"); }
void MemManage_Handler(void) { fault("memory management"); }
void BusFault_Handler(void) { fault("bus fault"); }
void UsageFault_Handler(void) { fault("usage fault"); }
void Default_Handler(void) { fault("unexpected interrupt"); }

__attribute__((optimize("no-tree-loop-distribute-patterns"), noreturn)) void Reset_Handler(void)
{
    SCB_CPACR |= 0xFu << 20; /* CP10 and CP11: full access to the FPU */
    __asm__ volatile("dsb\n isb" ::: "memory");
    for (uint32_t *src = &__data_load, *dst = &__data_start; dst < &__data_end;)
        *dst++ = *src++;
    for (uint32_t *dst = &__bss_start; dst < &__bss_end;)
        *dst++ = 0;
    main();
    semihost_exit(0x20026u);
}

typedef void (*vector_t)(void);

__attribute__((section(".isr_vector"), used)) static const vector_t vectors[16 + 32] = {
    [0] = (vector_t)&__stack_top,
    [1] = Reset_Handler,
    [2] = Default_Handler, /* NMI */
    [3] = HardFault_Handler,
    [4] = MemManage_Handler,
    [5] = BusFault_Handler,
    [6] = UsageFault_Handler,
    [11] = Default_Handler, /* SVCall */
    [12] = Default_Handler, /* debug monitor */
    [14] = Default_Handler, /* PendSV */
    [15] = SysTick_Handler,
    [16 ... 47] = Default_Handler,
};
