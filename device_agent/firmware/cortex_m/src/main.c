/* poet-edge Cortex-M firmware: trains a small MLP step by step under a POET schedule, driven over
 * the serial link by device_agent/serial_bridge/board.py. */
#include "arena.h"
#include "board.h"
#include "error.h"
#include "executor.h"
#include "flash.h"
#include "link.h"
#include "model.h"

#include "pb_decode.h"
#include "pb_encode.h"
#include "poet/v1/mcu.pb.h"

#include <stdio.h>
#include <string.h>

#define PROTOCOL_VERSION 1u
#define PARAM_CHUNK_FLOATS 1000u  /* 4000 data bytes: an McuParamChunk well inside one message */

static poet_v1_McuMessage request;  /* large: a Schedule fits in it */
static poet_v1_McuMessage reply;
static uint8_t tx_buffer[LINK_MAX_PAYLOAD];
static uint32_t conversation;      /* the link generation the current request belongs to */

/* Copy a C string into a fixed nanopb string field, cut to fit. */
static void copy_string(char *dst, size_t size, const char *src)
{
    size_t n = strlen(src);
    if (n >= size)
        n = size - 1u;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static bool send_reply(void)
{
    pb_ostream_t out = pb_ostream_from_buffer(tx_buffer, sizeof tx_buffer);
    if (!pb_encode(&out, poet_v1_McuMessage_fields, &reply)) {
        board_log("encode failed");
        return false;
    }
    link_send_result_t sent = link_send(tx_buffer, (uint32_t)out.bytes_written, conversation);
    if (sent == LINK_GAVE_UP)
        board_log("link: no acknowledgement, waiting for a hello");
    return sent == LINK_SENT;
}

static bool reply_ok(void)
{
    memset(&reply, 0, sizeof reply);
    reply.which_body = poet_v1_McuMessage_ok_tag;
    return send_reply();
}

static bool reply_error(const char *message)
{
    memset(&reply, 0, sizeof reply);
    reply.which_body = poet_v1_McuMessage_error_tag;
    copy_string(reply.body.error.message, sizeof reply.body.error.message, message);
    board_log(message);
    return send_reply();
}

static bool reply_status(bool ok) { return ok ? reply_ok() : reply_error(fw_error_message); }

/* A hello's link settings hold from its reply on. */
static void reply_board_info(const poet_v1_McuHello *hello)
{
    link_configure(hello->max_fragment_bytes, hello->ack_timeout_ms);
    memset(&reply, 0, sizeof reply);
    reply.which_body = poet_v1_McuMessage_board_info_tag;
    poet_v1_McuBoardInfo *info = &reply.body.board_info;
    info->protocol_version = PROTOCOL_VERSION;
    copy_string(info->board, sizeof info->board, board_config.name);
    copy_string(info->platform, sizeof info->platform, board_config.platform);
    info->arena_bytes = board_config.arena_bytes;
    info->flash_bytes = flash_dev_size();
    info->param_bytes = board_config.param_bytes;
    info->max_payload_bytes = LINK_MAX_PAYLOAD;
    info->tick_hz = board_config.tick_hz;
    info->session_id = link_session();
    info->emulated = board_config.emulated;
    info->max_fragment_bytes = link_max_fragment();
    info->ack_timeout_ms = link_ack_timeout_ms();
    send_reply();
}

static uint32_t current_step;

/* Each instruction's event goes out as soon as it ran: the board waits for its ACK (stop-and-wait),
 * so the host sees the step as it runs. The wait is not part of the step's ticks. */
static bool send_event(uint32_t position, instruction_t ins, const instruction_record_t *record)
{
    memset(&reply, 0, sizeof reply);
    reply.which_body = poet_v1_McuMessage_instruction_event_tag;
    poet_v1_McuInstructionEvent *e = &reply.body.instruction_event;
    e->step = current_step;
    e->position = position;
    e->kind = (poet_v1_InstructionKind)ins.kind;
    e->node = ins.node;
    e->ticks = record->ticks;
    e->bytes_moved = record->bytes_moved;
    e->arena_in_use_bytes = record->arena_in_use;
    return send_reply();
}

static void run_step(uint32_t step)
{
    step_result_t r;
    current_step = step;
    step_status_t status = executor_run_step(&r, send_event);
    if (status == STEP_ABORTED)
        return;  /* the link is gone or restarted: nobody waits for this step's answer */
    if (status == STEP_FAILED) {
        reply_error(fw_error_message);
        return;
    }
    memset(&reply, 0, sizeof reply);
    reply.which_body = poet_v1_McuMessage_step_done_tag;
    poet_v1_McuStepDone *d = &reply.body.step_done;
    d->step = step;
    d->loss = r.loss;
    d->ticks = r.ticks;
    d->arena_high_water_bytes = arena_high_water();
    d->computes = r.computes;
    d->page_ins = r.page_ins;
    d->page_outs = r.page_outs;
    d->frees = r.frees;
    d->bytes_paged_out = r.bytes_paged_out;
    d->bytes_paged_in = r.bytes_paged_in;
    d->link_crc_errors = link_crc_errors();
    d->link_retransmissions = link_retransmissions();
    send_reply();
}

static void read_params(void)
{
    if (!model.loaded) {
        reply_error("no model loaded");
        return;
    }
    for (uint32_t layer = 0; layer < model.layer_count; layer++) {
        if (model.layers[layer].op != poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR)
            continue;
        for (uint32_t tensor = 0; tensor < 2; tensor++) {
            float *data;
            uint32_t count;
            model_param_tensor(layer, tensor, &data, &count);
            for (uint32_t offset = 0; offset < count; offset += PARAM_CHUNK_FLOATS) {
                uint32_t n = count - offset < PARAM_CHUNK_FLOATS ? count - offset : PARAM_CHUNK_FLOATS;
                memset(&reply, 0, sizeof reply);
                reply.which_body = poet_v1_McuMessage_param_chunk_tag;
                poet_v1_McuParamChunk *c = &reply.body.param_chunk;
                c->layer = layer;
                c->tensor = tensor;
                c->offset = offset;
                c->data.size = (pb_size_t)(n * 4u);
                memcpy(c->data.bytes, data + offset, n * 4u);
                if (!send_reply())
                    return;
            }
        }
    }
    reply_ok();
}

static void handle(const uint8_t *payload, uint32_t length, bool is_hello)
{
    pb_istream_t in = pb_istream_from_buffer(payload, length);
    bool decoded = pb_decode(&in, poet_v1_McuMessage_fields, &request);
    link_release();  /* the request is decoded: the link may take the next message */
    if (!decoded) {
        char message[FW_ERROR_MAX];
        snprintf(message, sizeof message, "cannot decode the McuMessage (%lu bytes): %s", (unsigned long)length,
                 PB_GET_ERROR(&in));
        reply_error(message);
        return;
    }
    if (is_hello) {
        if (request.which_body != poet_v1_McuMessage_hello_tag) {
            reply_error("a frame with session 0 must carry an McuHello");
            return;
        }
        reply_board_info(&request.body.hello);
        return;
    }
    switch (request.which_body) {
    case poet_v1_McuMessage_hello_tag: reply_board_info(&request.body.hello); break;
    case poet_v1_McuMessage_load_model_tag:
        reply_status(request.body.load_model.has_model ? model_load(&request.body.load_model.model)
                                                       : fail("McuLoadModel without a model"));
        break;
    case poet_v1_McuMessage_load_schedule_tag:
        reply_status(request.body.load_schedule.has_schedule ? executor_load(&request.body.load_schedule.schedule)
                                                             : fail("McuLoadSchedule without a schedule"));
        break;
    case poet_v1_McuMessage_param_chunk_tag: {
        const poet_v1_McuParamChunk *c = &request.body.param_chunk;
        reply_status(model_write_params(c->layer, c->tensor, c->offset, c->data.bytes, c->data.size));
        break;
    }
    case poet_v1_McuMessage_batch_chunk_tag: {
        const poet_v1_McuBatchChunk *c = &request.body.batch_chunk;
        reply_status(model_batch_chunk(c->offset, c->inputs.bytes, c->inputs.size, c->labels, c->labels_count));
        break;
    }
    case poet_v1_McuMessage_run_step_tag: run_step(request.body.run_step.step); break;
    case poet_v1_McuMessage_read_params_tag: read_params(); break;
    default: {
        char message[FW_ERROR_MAX];
        snprintf(message, sizeof message, "the board does not take McuMessage field %u from the host",
                 (unsigned)request.which_body);
        reply_error(message);
    }
    }
}

int main(void)
{
    board_init();
    arena_init(board_config.arena, board_config.arena_bytes);
    pages_reset();
    if (flash_dev_open() != 0)
        board_log(flash_dev_error());
    uint32_t session = board_entropy();
    link_init(session ? session : 1u);
    char line[80];
    snprintf(line, sizeof line, "poet_fw up: board %s session %08lx", board_config.name, (unsigned long)link_session());
    board_log(line);
    for (;;) {
        uint32_t length;
        bool is_hello;
        const uint8_t *payload = link_poll(&length, &is_hello, &conversation);
        if (payload)
            handle(payload, length, is_hello);
    }
}
