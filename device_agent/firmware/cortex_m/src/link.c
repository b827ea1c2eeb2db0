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
static bool resend_now;  /* while waiting: a damaged frame or a repeated ACK says the host did not get it */
static bool took_data;   /* a DATA other than the hello was taken in this conversation */
static uint32_t crc_errors, retransmissions, reassembly_overflows;
static uint32_t max_fragment = LINK_MAX_PAYLOAD;  /* the most payload bytes in one DATA frame we send */
static uint32_t ack_timeout_ms = LINK_ACK_TIMEOUT_MS;

/* receiver state */
static uint8_t body[BODY_MAX];
static uint32_t body_length;
static bool escaping, overflow;

/* the one delivered, not yet released, message; while inbox_full is false, the fragments of the
 * message coming in are put together here (assembled bytes so far) */
static uint8_t inbox[LINK_MAX_PAYLOAD];
static uint32_t inbox_length, assembled;
static bool inbox_full, inbox_hello;
static bool discarding;  /* the message coming in overflowed: its fragments are ACKed and dropped */

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
    assembled = 0;
    discarding = false;
    resend_now = took_data = false;
    link_configure(0, 0);
}

void link_configure(uint32_t max_fragment_bytes, uint32_t timeout_ms)
{
    if (max_fragment_bytes == 0 || max_fragment_bytes > LINK_MAX_PAYLOAD)
        max_fragment_bytes = LINK_MAX_PAYLOAD;
    max_fragment = max_fragment_bytes < LINK_MIN_FRAGMENT ? LINK_MIN_FRAGMENT : max_fragment_bytes;
    if (timeout_ms == 0)
        timeout_ms = LINK_ACK_TIMEOUT_MS;
    ack_timeout_ms = timeout_ms > LINK_MAX_ACK_TIMEOUT_MS ? LINK_MAX_ACK_TIMEOUT_MS : timeout_ms;
}

uint32_t link_max_fragment(void) { return max_fragment; }
uint32_t link_ack_timeout_ms(void) { return ack_timeout_ms; }
uint32_t link_session(void) { return session; }
uint32_t link_crc_errors(void) { return crc_errors; }
uint32_t link_retransmissions(void) { return retransmissions; }
uint32_t link_reassembly_overflows(void) { return reassembly_overflows; }

static void emit_escaped(uint8_t byte, void (*emit)(uint8_t))
{
    if (byte == FLAG || byte == ESC) {
        emit(ESC);
        emit(byte ^ 0x20u);
    } else {
        emit(byte);
    }
}

uint32_t link_encode_frame(uint8_t kind, uint8_t flags, uint16_t seq, uint32_t session_id, const uint8_t *payload,
                           uint32_t length, void (*emit)(uint8_t byte))
{
    uint8_t header[LINK_HEADER_BYTES] = {kind, flags, (uint8_t)seq, (uint8_t)(seq >> 8), (uint8_t)session_id,
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

static void send_ack(uint16_t seq) { link_encode_frame(LINK_KIND_ACK, 0, seq, session, NULL, 0, board_uart_putc); }

/* A damaged frame arrived (bad CRC, too short or long, aborted). Waiting for an ACK, it most likely
 * was that ACK: send the DATA again now. Otherwise it most likely was the host's DATA: repeat the ACK
 * of the last DATA taken, which tells the host (waiting for the next one's) to send it again now. */
static void damaged(void)
{
    if (waiting_ack)
        resend_now = true;
    else if (connected && took_data)
        send_ack((uint16_t)(rx_expected - 1u));
}

static void handle_frame(void)
{
    if (body_length < LINK_HEADER_BYTES + 4u) {
        damaged();  /* short */
        return;
    }
    uint32_t length = body_length - LINK_HEADER_BYTES - 4u;
    if (crc32_update(0, body, body_length - 4u) != get_u32(body + body_length - 4u)) {
        crc_errors++;
        damaged();
        return;
    }
    uint8_t kind = body[0];
    bool more = (body[1] & LINK_FLAG_MORE) != 0;
    uint16_t seq = (uint16_t)(body[2] | body[3] << 8);
    uint32_t frame_session = get_u32(body + 4);
    const uint8_t *payload = body + LINK_HEADER_BYTES;
    if (kind == LINK_KIND_ACK) {
        if (length == 0 && waiting_ack && (frame_session == session || frame_session == 0)) {
            if (seq == tx_seq)
                acked = true;
            else if (seq == (uint16_t)(tx_seq - 1u))
                resend_now = true;  /* the host repeats its last ACK: our DATA did not arrive whole */
        }
        return;
    }
    if (kind != LINK_KIND_DATA)
        return;
    if (frame_session == 0) {  /* hello: a new conversation, in one frame whatever its flags */
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
        assembled = 0;
        discarding = false;
        took_data = false;
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
        if (discarding) {
            discarding = more;  /* the rest of a message that overflowed */
        } else if (length > LINK_MAX_PAYLOAD - assembled) {
            reassembly_overflows++;  /* over the limit: the whole message is dropped */
            assembled = 0;
            discarding = more;
        } else {
            memcpy(inbox + assembled, payload, length);
            assembled += length;
            if (!more) {
                inbox_length = assembled;
                assembled = 0;
                inbox_full = true;
                inbox_hello = false;
            }
        }
        rx_expected++;
        took_data = true;
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
        else if (escaping || overflow)
            damaged();  /* aborted, or longer than any frame */
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

/* One DATA frame until its ACK: again after every ack_timeout_ms, and at once when the host shows it
 * did not get it; gives up after LINK_MAX_RETRIES timeouts or LINK_GIVE_UP_MS of them, whichever is
 * more (or as many early resends). */
static link_send_result_t send_frame(const uint8_t *payload, uint32_t length, uint8_t flags, uint32_t gen)
{
    const uint64_t timeout = board_config.tick_hz * ack_timeout_ms / 1000u;
    const uint32_t by_time = LINK_GIVE_UP_MS / ack_timeout_ms;
    const uint32_t retries = by_time > LINK_MAX_RETRIES ? by_time : LINK_MAX_RETRIES;
    uint32_t timeouts = 0, early = 0;
    waiting_ack = true;
    acked = false;
    for (;;) {
        resend_now = false;
        link_encode_frame(LINK_KIND_DATA, flags, tx_seq, session, payload, length, board_uart_putc);
        uint64_t sent = board_ticks();
        while (!resend_now && board_ticks() - sent < timeout) {
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
        if (resend_now ? ++early > retries : ++timeouts > retries)
            break;
        retransmissions++;
    }
    waiting_ack = false;
    connected = false;
    return LINK_GAVE_UP;
}

link_send_result_t link_send(const uint8_t *payload, uint32_t length, uint32_t gen)
{
    pump();  /* a hello already waiting makes this reply stale */
    if (gen != generation)
        return LINK_RESET;
    if (!connected)
        return LINK_GAVE_UP;
    uint32_t offset = 0;
    do {
        uint32_t n = length - offset < max_fragment ? length - offset : max_fragment;
        link_send_result_t sent =
            send_frame(payload + offset, n, offset + n < length ? LINK_FLAG_MORE : 0u, gen);
        if (sent != LINK_SENT)
            return sent;  /* a hello, or giving up, ends the message: the host starts over with a hello */
        offset += n;
    } while (offset < length);
    return LINK_SENT;
}
