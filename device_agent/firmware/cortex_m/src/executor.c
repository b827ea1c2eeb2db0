#include "executor.h"

#include "arena.h"
#include "board.h"
#include "error.h"
#include "flash.h"
#include "model.h"
#include "ops.h"

#include <stdio.h>
#include <string.h>

enum { KIND_FWD = 1, KIND_LOSS = 2, KIND_BWD = 3 };

typedef struct {
    char name[48];
    uint8_t kind;
    uint8_t dep_count;
    uint8_t deps[8];
    uint32_t output_bytes;
} node_t;

static node_t nodes[MODEL_MAX_NODES];
static uint32_t node_count;
static instruction_t instructions[EXECUTOR_MAX_INSTRUCTIONS];
static uint32_t instruction_count;
static bool loaded;

static void *ram[MODEL_MAX_NODES];  /* arena address of each node's RAM copy (NULL for 0 bytes) */
static bool in_ram[MODEL_MAX_NODES];
static bool on_flash[MODEL_MAX_NODES];
static bool computed[MODEL_MAX_NODES];

bool executor_loaded(void) { return loaded; }
uint32_t executor_instruction_count(void) { return instruction_count; }
instruction_t executor_instruction(uint32_t position) { return instructions[position]; }

static const layer_t *layer_of(uint32_t n) { return &model.layers[model.node_layer[n]]; }
static bool is_forward(uint32_t n) { return nodes[n].kind != KIND_BWD; }

/* The schedule's nodes must be the model's, wired as mcu.proto's McuModel comment says. */
static bool check_against_model(void)
{
    if (!model.loaded)
        return fail("no model loaded: send McuLoadModel before the schedule");
    if (model.node_count != node_count)
        return fail("the model maps %lu nodes onto layers; the schedule has %lu nodes",
                    (unsigned long)model.node_count, (unsigned long)node_count);
    for (uint32_t n = 0; n < node_count; n++) {
        const node_t *nd = &nodes[n];
        uint32_t L = model.node_layer[n];
        poet_v1_McuLayerOp op = model.layers[L].op;
        bool fwd = is_forward(n);
        bool input = op == poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT;
        bool loss = op == poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY;
        if (fwd && (nd->kind == KIND_LOSS) != loss)
            return fail("node %lu '%s' (layer %lu): the loss layer's forward node, and only it, has kind loss",
                        (unsigned long)n, nd->name, (unsigned long)L);
        if (input && !fwd)
            return fail("node %lu '%s': the input layer has no backward node", (unsigned long)n, nd->name);
        uint32_t want = input ? 0u : (fwd || loss) ? 1u : 2u;
        if (nd->dep_count != want)
            return fail("node %lu '%s' has %u deps; a %s %s node has %lu", (unsigned long)n, nd->name,
                        nd->dep_count, fwd ? "forward" : "backward", input ? "input" : loss ? "loss" : "layer",
                        (unsigned long)want);
        if (fwd && !input) {
            uint32_t d = nd->deps[0];
            if (!is_forward(d) || model.node_layer[d] != L - 1)
                return fail("node %lu '%s': its dep %lu must be the forward node of layer %lu", (unsigned long)n,
                            nd->name, (unsigned long)d, (unsigned long)(L - 1));
        } else if (!fwd && loss) {
            uint32_t d = nd->deps[0];
            if (nodes[d].kind != KIND_LOSS || model.node_layer[d] != L)
                return fail("node %lu '%s': its dep must be the loss node", (unsigned long)n, nd->name);
        } else if (!fwd) {
            uint32_t g = nd->deps[0], s = nd->deps[1];
            if (is_forward(g) || model.node_layer[g] != L + 1)
                return fail("node %lu '%s': its first dep %lu must be the backward node of layer %lu",
                            (unsigned long)n, nd->name, (unsigned long)g, (unsigned long)(L + 1));
            uint32_t saved_layer = op == poet_v1_McuLayerOp_MCU_LAYER_OP_RELU ? L : L - 1;
            if (!is_forward(s) || model.node_layer[s] != saved_layer)
                return fail("node %lu '%s': its second dep %lu must be the forward node of layer %lu",
                            (unsigned long)n, nd->name, (unsigned long)s, (unsigned long)saved_layer);
        }
    }
    return true;
}

bool executor_load(const poet_v1_Schedule *s)
{
    loaded = false;
    if (s->nodes_count == 0 || s->instructions_count == 0)
        return fail("schedule has %u nodes and %u instructions", (unsigned)s->nodes_count,
                    (unsigned)s->instructions_count);
    node_count = s->nodes_count;
    for (uint32_t n = 0; n < node_count; n++) {
        const poet_v1_ScheduleNode *src = &s->nodes[n];
        node_t *dst = &nodes[n];
        memcpy(dst->name, src->name, sizeof dst->name);
        if (strcmp(src->kind, "fwd") == 0)
            dst->kind = KIND_FWD;
        else if (strcmp(src->kind, "loss") == 0)
            dst->kind = KIND_LOSS;
        else if (strcmp(src->kind, "bwd") == 0)
            dst->kind = KIND_BWD;
        else
            return fail("node %lu '%s' has kind '%s' (fwd, loss or bwd)", (unsigned long)n, src->name, src->kind);
        if (src->output_bytes > board_config.arena_bytes)
            return fail("node %lu '%s' declares %llu bytes; the arena has %lu", (unsigned long)n, src->name,
                        (unsigned long long)src->output_bytes, (unsigned long)board_config.arena_bytes);
        dst->output_bytes = (uint32_t)src->output_bytes;
        dst->dep_count = (uint8_t)src->deps_count;
        for (uint32_t d = 0; d < src->deps_count; d++) {
            if (src->deps[d] >= node_count)
                return fail("node %lu '%s' depends on node %lu, beyond the %lu nodes", (unsigned long)n, src->name,
                            (unsigned long)src->deps[d], (unsigned long)node_count);
            dst->deps[d] = (uint8_t)src->deps[d];
        }
    }
    instruction_count = s->instructions_count;
    for (uint32_t i = 0; i < instruction_count; i++) {
        const poet_v1_Instruction *src = &s->instructions[i];
        if (src->kind < poet_v1_InstructionKind_INSTRUCTION_KIND_COMPUTE ||
            src->kind > poet_v1_InstructionKind_INSTRUCTION_KIND_FREE)
            return fail("instruction %lu has an unknown kind (%d)", (unsigned long)i, (int)src->kind);
        if (src->node >= node_count)
            return fail("instruction %lu names node %lu; the schedule has %lu nodes", (unsigned long)i,
                        (unsigned long)src->node, (unsigned long)node_count);
        if (src->kind == poet_v1_InstructionKind_INSTRUCTION_KIND_FREE &&
            src->location != poet_v1_Location_LOCATION_RAM && src->location != poet_v1_Location_LOCATION_FLASH)
            return fail("instruction %lu frees node %lu at an unknown location (%d)", (unsigned long)i,
                        (unsigned long)src->node, (int)src->location);
        instructions[i] = (instruction_t){.kind = (uint8_t)src->kind, .location = (uint8_t)src->location,
                                          .node = (uint16_t)src->node};
    }
    if (!check_against_model())
        return false;
    arena_reset();
    arena_reset_high_water();
    loaded = true;
    return true;
}

/* The address of node n's output while it is in RAM (the input node's is the batch). */
static const float *data_of(uint32_t n)
{
    if (layer_of(n)->op == poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT)
        return model.inputs;
    return (const float *)ram[n];
}

/* Bytes the op writes into node n's output; with *skip set, a backward linear node declared with
 * 0 bytes computes only its weight gradients. */
static uint32_t needed_bytes(uint32_t n, bool *skip_grad_input)
{
    const layer_t *l = layer_of(n);
    uint32_t B = model.batch;
    *skip_grad_input = false;
    switch (l->op) {
    case poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT: return 0;
    case poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY:
        return is_forward(n) ? 4u * B * l->out + 4u : 4u * B * l->in;
    case poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR:
        if (is_forward(n))
            return 4u * B * l->out;
        if (nodes[n].output_bytes == 0) {
            *skip_grad_input = true;
            return 0;
        }
        return 4u * B * l->in;
    default: return 4u * B * l->out;
    }
}

static float step_loss;

static bool compute(uint32_t n)
{
    const node_t *nd = &nodes[n];
    if (in_ram[n])
        return fail("node '%s' is already in RAM", nd->name);
    for (uint32_t d = 0; d < nd->dep_count; d++)
        if (!in_ram[nd->deps[d]])
            return fail("needs node %u '%s' in RAM", nd->deps[d], nodes[nd->deps[d]].name);
    bool skip;
    uint32_t need = needed_bytes(n, &skip);
    if (need > nd->output_bytes)
        return fail("the op writes %lu bytes; the schedule declares %lu", (unsigned long)need,
                    (unsigned long)nd->output_bytes);
    if (!arena_alloc(nd->output_bytes, &ram[n]))
        return false;
    in_ram[n] = true;
    layer_t *l = (layer_t *)layer_of(n);
    uint32_t B = model.batch;
    float *out = (float *)ram[n];
    if (is_forward(n)) {
        const float *x = l->op == poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT ? NULL : data_of(nd->deps[0]);
        switch (l->op) {
        case poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT: break;
        case poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR: linear_forward(x, l->w, l->b, out, B, l->in, l->out); break;
        case poet_v1_McuLayerOp_MCU_LAYER_OP_RELU: relu_forward(x, out, B * l->out); break;
        case poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY:
            step_loss = cross_entropy_forward(x, model.labels, out, B, l->out);
            out[B * l->out] = step_loss;
            break;
        default: break;
        }
    } else {
        const float *g = data_of(nd->deps[0]);
        switch (l->op) {
        case poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY:
            cross_entropy_backward(g, model.labels, out, B, l->in);
            break;
        case poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR:
            linear_backward(g, data_of(nd->deps[1]), l->w, skip ? NULL : out, l->gw, l->gb, B, l->in, l->out);
            break;
        case poet_v1_McuLayerOp_MCU_LAYER_OP_RELU: relu_backward(g, data_of(nd->deps[1]), out, B * l->in); break;
        default: break;
        }
    }
    computed[n] = true;
    return true;
}

static bool execute(instruction_t ins, step_result_t *r, uint32_t *moved)
{
    uint32_t n = ins.node;
    const node_t *nd = &nodes[n];
    *moved = 0;
    switch (ins.kind) {
    case poet_v1_InstructionKind_INSTRUCTION_KIND_COMPUTE:
        r->computes++;
        return compute(n);
    case poet_v1_InstructionKind_INSTRUCTION_KIND_PAGE_OUT:
        if (!in_ram[n])
            return fail("cannot page out: not in RAM");
        if (on_flash[n])
            return fail("already on flash");
        if (!page_write(n, ram[n], nd->output_bytes))
            return false;
        on_flash[n] = true;
        r->page_outs++;
        r->bytes_paged_out += nd->output_bytes;
        *moved = nd->output_bytes;
        return true;
    case poet_v1_InstructionKind_INSTRUCTION_KIND_PAGE_IN:
        if (!on_flash[n])
            return fail("cannot page in: no copy on flash");
        if (in_ram[n])
            return fail("already in RAM");
        if (!arena_alloc(nd->output_bytes, &ram[n]))
            return false;
        if (!page_read(n, ram[n], nd->output_bytes)) {
            arena_free(&ram[n]);
            return false;
        }
        in_ram[n] = true;
        r->page_ins++;
        r->bytes_paged_in += nd->output_bytes;
        *moved = nd->output_bytes;
        return true;
    default: /* FREE */
        r->frees++;
        if (ins.location == poet_v1_Location_LOCATION_RAM) {
            if (!in_ram[n])
                return fail("cannot free from RAM: it is not there");
            arena_free(&ram[n]);
            in_ram[n] = false;
        } else {
            if (!on_flash[n])
                return fail("cannot free from flash: it is not there");
            if (!page_free(n))
                return false;
            on_flash[n] = false;
        }
        return true;
    }
}

static void release_all(void)
{
    arena_reset();
    pages_reset();
    memset(in_ram, 0, sizeof in_ram);
    memset(on_flash, 0, sizeof on_flash);
}

static const char *kind_name(uint8_t kind)
{
    static const char *names[] = {"?", "compute", "page_out", "page_in", "free"};
    return kind <= 4 ? names[kind] : "?";
}

step_status_t executor_run_step(step_result_t *r, instruction_done_t done)
{
    memset(r, 0, sizeof *r);
    if (!loaded)
        return fail("no schedule loaded"), STEP_FAILED;
    if (!check_against_model())
        return STEP_FAILED;
    if (!model_batch_ready())
        return fail("the batch is incomplete: %lu of %lu inputs%s", (unsigned long)model.inputs_received,
                    (unsigned long)(model.batch * model.features), model.labels_received ? "" : ", no labels"),
               STEP_FAILED;
    release_all();
    memset(computed, 0, sizeof computed);
    step_loss = 0.0f;
    uint64_t start = board_ticks(), outside = 0;
    model_zero_grads();
    for (uint32_t pos = 0; pos < instruction_count; pos++) {
        instruction_t ins = instructions[pos];
        uint32_t moved;
        uint64_t t0 = board_ticks();
        if (!execute(ins, r, &moved)) {
            char reason[FW_ERROR_MAX];
            memcpy(reason, fw_error_message, sizeof reason);
            release_all();
            fail("instruction %lu (%s node %u '%s'%s): %s", (unsigned long)pos, kind_name(ins.kind), ins.node,
                 nodes[ins.node].name,
                 ins.kind != poet_v1_InstructionKind_INSTRUCTION_KIND_FREE ? ""
                 : ins.location == poet_v1_Location_LOCATION_RAM ? " @ram" : " @flash",
                 reason);
            return STEP_FAILED;
        }
        uint64_t t1 = board_ticks();
        instruction_record_t record = {.ticks = t1 - t0, .bytes_moved = moved, .arena_in_use = arena_in_use()};
        if (done && !done(pos, ins, &record)) {
            release_all();
            return STEP_ABORTED;
        }
        outside += board_ticks() - t1;
    }
    for (uint32_t n = 0; n < node_count; n++) {
        if (!computed[n] || in_ram[n] || on_flash[n]) {
            fail("after the last instruction node %lu '%s' %s", (unsigned long)n, nodes[n].name,
                 !computed[n] ? "was never computed" : in_ram[n] ? "is still in RAM" : "is still on flash");
            release_all();
            return STEP_FAILED;
        }
    }
    model_sgd_step();
    r->ticks = board_ticks() - start - outside;
    r->loss = step_loss;
    return STEP_DONE;
}
