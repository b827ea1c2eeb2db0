/* The link (src/link.c) on the host, against a scripted peer: golden frames shared with
 * device_agent/serial_bridge/framing.py's tests, hello and sessions, stop-and-wait delivery,
 * duplicates, CRC errors, aborted frames, retransmission and giving up. `make host-test` runs it. */
#include "board.h"
#include "link.h"

#include <stdio.h>
#include <string.h>

const board_config_t board_config = {.name = "host", .platform = "test", .tick_hz = 1000000};

/* ---- the scripted peer behind the stub UART ---- */
static uint8_t to_board[16384];
static uint32_t to_board_len, to_board_pos;
static uint8_t from_board[65536];
static uint32_t from_board_len;
static uint64_t now;
static int ack_after = -1;       /* ACK the board's DATA from this transmission on (-1: never) */
static int transmissions;
static bool hello_on_transmission;

uint64_t board_ticks(void) { return now += 1000; } /* every look at the clock: 1 ms passes */
void board_idle(void) {}
uint32_t board_entropy(void) { return 1; }
void board_log(const char *line) { (void)line; }
void board_init(void) {}

static void queue(const uint8_t *bytes, uint32_t n)
{
    memcpy(to_board + to_board_len, bytes, n);
    to_board_len += n;
}

static void queue_byte(uint8_t byte) { to_board[to_board_len++] = byte; }

int board_uart_getc(void) { return to_board_pos < to_board_len ? to_board[to_board_pos++] : -1; }

static uint8_t sink[8192];
static uint32_t sink_len;
static void to_sink(uint8_t byte) { sink[sink_len++] = byte; }

/* The wire bytes of a frame, through the firmware's own encoder. */
static uint32_t frame(uint8_t kind, uint16_t seq, uint32_t session, const void *payload, uint32_t n, uint8_t *out)
{
    sink_len = 0;
    link_encode_frame(kind, seq, session, payload, n, to_sink);
    memcpy(out, sink, sink_len);
    return sink_len;
}

static void send_to_board(uint8_t kind, uint16_t seq, uint32_t session, const char *payload)
{
    uint8_t wire[512];
    uint32_t n = frame(kind, seq, session, payload, payload ? (uint32_t)strlen(payload) : 0, wire);
    queue(wire, n);
}

void board_uart_putc(uint8_t byte)
{
    from_board[from_board_len++] = byte;
    /* a DATA frame just ended: the peer answers as scripted */
    if (byte == 0x7E && from_board_len > 2 && from_board[0] == 0x7E && from_board[1] == LINK_KIND_DATA) {
        transmissions++;
        uint16_t seq = (uint16_t)(from_board[3] | from_board[4] << 8);
        uint32_t session = link_session();
        from_board_len = 0;
        if (hello_on_transmission) {
            hello_on_transmission = false;
            send_to_board(LINK_KIND_DATA, 9, 0, "hello again");
        } else if (ack_after >= 0 && transmissions > ack_after) {
            send_to_board(LINK_KIND_ACK, seq, session, NULL);
        }
    }
}

/* ---- checks ---- */
static int failures;

static void check(int condition, const char *what)
{
    printf("%s %s\n", condition ? "ok  " : "FAIL", what);
    failures += !condition;
}

static bool board_sent(uint8_t kind, uint16_t seq, uint32_t session)
{
    uint8_t wire[64];
    uint32_t n = frame(kind, seq, session, NULL, 0, wire);
    bool same = from_board_len == n && memcmp(from_board, wire, n) == 0;
    from_board_len = 0;
    return same;
}

static const uint8_t *poll_payload(uint32_t *n, bool *hello)
{
    uint32_t generation;
    return link_poll(n, hello, &generation);
}

static bool delivered(const char *text, bool want_hello)
{
    uint32_t n;
    bool hello;
    const uint8_t *p = poll_payload(&n, &hello);
    bool ok = p && n == strlen(text) && memcmp(p, text, n) == 0 && hello == want_hello;
    if (p)
        link_release();
    return ok;
}

int main(void)
{
    const uint32_t S = 0x5EED1234u;
    uint8_t wire[64];

    static const uint8_t golden_data[] = {0x7e, 0x01, 0x00, 0x01, 0x00, 0x78, 0x56, 0x34, 0x12, 0x7d,
                                          0x5e, 0x7d, 0x5d, 0x00, 0x41, 0x65, 0x6b, 0xdb, 0x63, 0x7e};
    static const uint8_t golden_ack[] = {0x7e, 0x02, 0x00, 0xef, 0xbe, 0x0d, 0xf0, 0xfe, 0xca, 0xa6, 0x8b, 0xc2, 0xd9, 0x7e};
    static const uint8_t payload[] = {0x7e, 0x7d, 0x00, 0x41};
    check(frame(LINK_KIND_DATA, 1, 0x12345678u, payload, 4, wire) == sizeof golden_data &&
              memcmp(wire, golden_data, sizeof golden_data) == 0,
          "DATA frame bytes equal framing.py's golden frame");
    check(frame(LINK_KIND_ACK, 0xBEEF, 0xCAFEF00Du, NULL, 0, wire) == sizeof golden_ack &&
              memcmp(wire, golden_ack, sizeof golden_ack) == 0,
          "ACK frame bytes equal framing.py's golden frame");

    link_init(S);
    send_to_board(LINK_KIND_DATA, 0, S, "before hello");
    check(poll_payload(&(uint32_t){0}, &(bool){0}) == NULL && from_board_len == 0,
          "DATA before any hello is neither delivered nor ACKed");

    send_to_board(LINK_KIND_DATA, 0, 0, "hello");
    check(delivered("hello", true) && board_sent(LINK_KIND_ACK, 0, S), "a hello (session 0) is delivered and ACKed");

    send_to_board(LINK_KIND_DATA, 1, S, "one");
    check(delivered("one", false) && board_sent(LINK_KIND_ACK, 1, S), "DATA seq 1 is delivered and ACKed");
    send_to_board(LINK_KIND_DATA, 1, S, "one");
    check(!delivered("one", false) && board_sent(LINK_KIND_ACK, 1, S), "its duplicate is ACKed again, not delivered");
    send_to_board(LINK_KIND_DATA, 3, S, "three");
    check(!delivered("three", false) && from_board_len == 0, "an out-of-sequence DATA is dropped unACKed");
    send_to_board(LINK_KIND_DATA, 2, S ^ 1u, "old boot");
    check(!delivered("old boot", false) && board_sent(LINK_KIND_ACK, 2, S),
          "another session's DATA is not delivered; its ACK carries this boot's session");

    send_to_board(LINK_KIND_DATA, 2, S, "two");
    to_board[to_board_len - 3] ^= 0x01u; /* a bit of the CRC flips on the line */
    uint32_t crc_before = link_crc_errors();
    check(!delivered("two", false) && link_crc_errors() == crc_before + 1 && from_board_len == 0,
          "a frame with a bad CRC is counted and dropped");
    queue_byte(0x7E);
    queue_byte(LINK_KIND_DATA);
    queue_byte(0x7D);
    queue_byte(0x7E); /* 0x7D then 0x7E: the frame is aborted */
    send_to_board(LINK_KIND_DATA, 2, S, "two");
    check(delivered("two", false) && board_sent(LINK_KIND_ACK, 2, S), "after an aborted frame the next one arrives");

    send_to_board(LINK_KIND_DATA, 3, S, "three");
    uint32_t n, generation;
    bool hello;
    check(poll_payload(&n, &hello) != NULL && board_sent(LINK_KIND_ACK, 3, S), "seq 3 delivered");
    send_to_board(LINK_KIND_DATA, 4, S, "four"); /* arrives while the board answers "three" */
    link_poll(&n, &hello, &generation);
    transmissions = 0;
    ack_after = 0;
    check(link_send((const uint8_t *)"answer", 6, generation) == LINK_SENT && from_board_len == 0,
          "while a message waits unreleased, the next DATA is not ACKed");
    link_release();
    send_to_board(LINK_KIND_DATA, 4, S, "four");
    check(delivered("four", false) && board_sent(LINK_KIND_ACK, 4, S), "sent again after the release, it arrives");

    transmissions = 0;
    ack_after = 2;
    uint32_t resent = link_retransmissions();
    check(link_send((const uint8_t *)"reply", 5, generation) == LINK_SENT && transmissions == 3 &&
              link_retransmissions() == resent + 2,
          "a DATA whose ACKs are lost is sent again every 100 ms until ACKed (2 retransmissions counted)");

    hello_on_transmission = true;
    check(link_send((const uint8_t *)"stale", 5, generation) == LINK_RESET, "a hello during a send aborts it");
    check(delivered("hello again", true), "and is delivered as a hello");
    link_poll(&n, &hello, &generation);
    check(link_send((const uint8_t *)"stale", 5, generation - 1u) == LINK_RESET,
          "a reply of the conversation before the hello is not sent");
    from_board_len = 0;

    transmissions = 0;
    ack_after = -1;
    check(link_send((const uint8_t *)"void", 4, generation) == LINK_GAVE_UP &&
              transmissions == (int)LINK_MAX_RETRIES + 1,
          "never ACKed, the board gives up after LINK_MAX_RETRIES retransmissions");
    send_to_board(LINK_KIND_DATA, 10, S, "after giving up");
    check(!delivered("after giving up", false) && from_board_len == 0, "then it takes only a hello");
    send_to_board(LINK_KIND_DATA, 0, 0, "hello");
    check(delivered("hello", true) && board_sent(LINK_KIND_ACK, 0, S), "a hello starts again");

    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
