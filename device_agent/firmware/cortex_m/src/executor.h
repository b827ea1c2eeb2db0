/* Runs a Schedule's instructions exactly, one training step at a time. */
#ifndef POET_EXECUTOR_H
#define POET_EXECUTOR_H

#include "poet/v1/schedule.pb.h"

#include <stdbool.h>
#include <stdint.h>

#define EXECUTOR_MAX_INSTRUCTIONS 512u  /* Schedule.instructions max_count (schedule.options) */

typedef struct {
    uint64_t ticks;          /* the instruction alone, in board ticks */
    uint32_t bytes_moved;    /* page_in / page_out */
    uint32_t arena_in_use;   /* declared bytes in the arena after it */
} instruction_record_t;

typedef struct {
    float loss;
    uint64_t ticks;          /* the whole step: instructions and optimizer */
    uint32_t computes, page_ins, page_outs, frees;
    uint64_t bytes_paged_out, bytes_paged_in;
} step_result_t;

typedef struct {
    uint8_t kind;      /* poet_v1_InstructionKind */
    uint8_t location;  /* poet_v1_Location */
    uint16_t node;
} instruction_t;

/* Keep the schedule (checked against the loaded model) and reset the arena's high-water mark. */
bool executor_load(const poet_v1_Schedule *schedule);
bool executor_loaded(void);
uint32_t executor_instruction_count(void);
instruction_t executor_instruction(uint32_t position);
typedef enum {
    STEP_DONE = 0,     /* every instruction ran, then the optimizer */
    STEP_FAILED = 1,   /* an instruction failed: fw_error names its position and node */
    STEP_ABORTED = 2,  /* the callback stopped the step (the link is gone) */
} step_status_t;

/* Called after each instruction, outside the step's timing (the firmware sends its event from here,
 * so the host sees the step as it runs); returning false aborts the step. */
typedef bool (*instruction_done_t)(uint32_t position, instruction_t instruction, const instruction_record_t *record);

/* One step on the loaded batch: every instruction, then the optimizer. Unless it is STEP_DONE the
 * parameters are unchanged and nothing stays allocated in the arena or on flash. */
step_status_t executor_run_step(step_result_t *result, instruction_done_t done);

#endif
