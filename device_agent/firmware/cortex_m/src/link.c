#include "link.h"

#include "board.h"
#include "crc32.h"

#include <string.h>

#define FLAG 0x7Eu
#define ESC 0x7Du
#define BODY_MAX (LINK_HEADER_BYTES + LINK_MAX_PAYLOAD + 4u)

static uint32_t session;
static bool connected;           /* a hello was seen and the link has not given up since */
static uint32_t generation;      /* hellos seen */
static uint16_t rx_expected;     /* next DATA seq to deliver */
static uint16_t tx_seq;          /* seq of the next (or in-flight) DATA the board sends */
static bool waiting_ack, acked;
static uint32_t crc_errors, retransmissions;

/* receiver state */
static uint8_t body[BODY_MAX];
static uint32_t body_length;
static bool escaping, overflow;

/* the one delivered, not yet released, message */
static uint8_t inbox[LINK_MAX_PAYLOAD];
static uint32_t inbox_length;
static bool inbox_full, inbox_hello;

static uint32_t get_u32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

void link_init(uint32_t session_id)
{
    session = session_id;
    connected = false;
    generation = 0;
    rx_expected = tx_seq = 0;
    waiting_ack = acked = false;
    body_length = 0;
    escaping = overflow = false;
    inbox_full = false;
}

uint32_t link_session(void) { return session; }
uint32_t link_crc_errors(void) { return crc_errors; }
uint32_t link_retransmissions(void) { return retransmissions; }

static void emit_escaped(uint8_t byte, void (*emit)(uint8_t))
{
    if (byte == FLAG || byte == ESC) {
        emit(ESC);
        emit(byte ^ 0x20u);
    } else {
        emit(byte);
    }
}

uint32_t link_encode_frame(uint8_t kind, uint16_t seq, uint32_t session_id, const uint8_t *payload, uint32_t length,
                           void (*emit)(uint8_t byte))
{
    uint8_t header[LINK_HEADER_BYTES] = {kind, 0, (uint8_t)seq, (uint8_t)(seq >> 8), (uint8_t)session_id,
                                         (uint8_t)(session_id >> 8), (uint8_t)(session_id >> 16),
                                         (uint8_t)(session_id >> 24)};
    uint32_t crc = crc32_update(crc32_update(0, header, sizeof header), payload, length);
    uint8_t trailer[4] = {(uint8_t)crc, (uint8_t)(crc >> 8), (uint8_t)(crc >> 16), (uint8_t)(crc >> 24)};
    emit(FLAG);
    for (uint32_t i = 0; i < sizeof header; i++)
        emit_escaped(header[i], emit);
    for (uint32_t i = 0; i < length; i++)
        emit_escaped(payload[i], emit);
    for (uint32_t i = 0; i < sizeof trailer; i++)
        emit_escaped(trailer[i], emit);
    emit(FLAG);
    return LINK_HEADER_BYTES + length + 4u;
}

static void send_ack(uint16_t seq) { link_encode_frame(LINK_KIND_ACK, seq, session, NULL, 0, board_uart_putc); }

static void handle_frame(void)
{
    if (body_length < LINK_HEADER_BYTES + 4u)
        return;  /* short */
    uint32_t length = body_length - LINK_HEADER_BYTES - 4u;
    if (crc32_update(0, body, body_length - 4u) != get_u32(body + body_length - 4u)) {
        crc_errors++;
        return;
    }
    uint8_t kind = body[0];
    uint16_t seq = (uint16_t)(body[2] | body[3] << 8);
    uint32_t frame_session = get_u32(body + 4);
    const uint8_t *payload = body + LINK_HEADER_BYTES;
    if (kind == LINK_KIND_ACK) {
        if (length == 0 && waiting_ack && (frame_session == session || frame_session == 0) && seq == tx_seq)
            acked = true;
        return;
    }
    if (kind != LINK_KIND_DATA)
        return;
    if (frame_session == 0) {  /* hello: a new conversation */
        rx_expected = (uint16_t)(seq + 1u);
        tx_seq = 0;
        connected = true;
        generation++;
        waiting_ack = false;
        send_ack(seq);
        memcpy(inbox, payload, length);
        inbox_length = length;
        inbox_full = true;
        inbox_hello = true;
        return;
    }
    if (frame_session != session) {
        /* A host still on an earlier boot's session: not delivered, but ACKed in this boot's session
         * so the host learns at once that the board restarted (and says hello again). */
        send_ack(seq);
        return;
    }
    if (!connected)
        return;  /* the link gave up: only a hello starts again */
    if (seq == rx_expected) {
        if (inbox_full)
            return;  /* not acknowledged: the host sends it again once the inbox is free */
        memcpy(inbox, payload, length);
        inbox_length = length;
        inbox_full = true;
        inbox_hello = false;
        rx_expected++;
        send_ack(seq);
    } else if (seq == (uint16_t)(rx_expected - 1u)) {
        send_ack(seq);  /* our ACK was lost: acknowledge again, deliver nothing */
    }
}

static void receive_byte(uint8_t byte)
{
    if (byte == FLAG) {
        if (!escaping && !overflow && body_length > 0)
            handle_frame();
        body_length = 0;
        escaping = overflow = false;
        return;
    }
    if (byte == ESC) {
        escaping = true;
        return;
    }
    if (escaping) {
        byte ^= 0x20u;
        escaping = false;
    }
    if (body_length < BODY_MAX)
        body[body_length++] = byte;
    else
        overflow = true;
}

/* Take every waiting byte; returns whether there was any. */
static bool pump(void)
{
    int c;
    bool any = false;
    while ((c = board_uart_getc()) >= 0) {
        receive_byte((uint8_t)c);
        any = true;
    }
    return any;
}

const uint8_t *link_poll(uint32_t *length, bool *is_hello, uint32_t *gen)
{
    if (!inbox_full && !pump() && !inbox_full)
        board_idle();
    *gen = generation;
    if (!inbox_full)
        return NULL;
    *length = inbox_length;
    *is_hello = inbox_hello;
    return inbox;
}

void link_release(void) { inbox_full = false; }

link_send_result_t link_send(const uint8_t *payload, uint32_t length, uint32_t gen)
{
    pump();  /* a hello already waiting makes this reply stale */
    if (gen != generation)
        return LINK_RESET;
    if (!connected)
        return LINK_GAVE_UP;
    const uint64_t timeout = board_config.tick_hz * LINK_ACK_TIMEOUT_MS / 1000u;
    waiting_ack = true;
    acked = false;
    for (uint32_t attempt = 0; attempt <= LINK_MAX_RETRIES; attempt++) {
        if (attempt)
            retransmissions++;
        link_encode_frame(LINK_KIND_DATA, tx_seq, session, payload, length, board_uart_putc);
        uint64_t sent = board_ticks();
        while (board_ticks() - sent < timeout) {
            if (!pump())
                board_idle();
            if (gen != generation)
                return LINK_RESET;
            if (acked) {
                waiting_ack = false;
                tx_seq++;
                return LINK_SENT;
            }
        }
    }
    waiting_ack = false;
    connected = false;
    return LINK_GAVE_UP;
}
