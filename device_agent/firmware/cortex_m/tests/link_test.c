/* The link (src/link.c) on the host, against a scripted peer: golden frames shared with
 * device_agent/serial_bridge/framing.py's tests, hello and sessions, stop-and-wait delivery,
 * duplicates, CRC errors, aborted frames, retransmission and giving up, fragmented messages both
 * ways (MORE flag, reassembly, overflow) and the hello's link settings. `make host-test` runs it. */
#include "board.h"
#include "link.h"

#include <stdio.h>
#include <string.h>

const board_config_t board_config = {.name = "host", .platform = "test", .tick_hz = 1000000};

/* ---- the scripted peer behind the stub UART ---- */
static uint8_t to_board[16384];  /* send_fragment() starts it over: a frame of 4096 bytes fits */
static uint32_t to_board_len, to_board_pos;
static uint8_t from_board[65536];
static uint32_t from_board_len;
static uint64_t now;
static int ack_after = -1;       /* ACK the board's DATA from this transmission on (-1: never) */
static int transmissions;
static bool hello_on_transmission;
static int damage_first;         /* answer the next transmissions with a damaged ACK ... */
static int repeat_first;         /* ... or with the ACK of the DATA before */

/* the board's DATA frames as the peer decoded them, in order */
#define SEEN_MAX 64
static struct {
    uint8_t flags;
    uint16_t seq;
    uint32_t length;
    uint8_t payload[64];
    uint64_t at;  /* the clock when the frame ended */
} seen[SEEN_MAX];
static uint32_t seen_count;

uint64_t board_ticks(void) { return now += 1000; } /* every look at the clock: 1 ms passes */

/* Unescape the frame in from_board (both flags included) and note it in seen[]. */
static void note_data_frame(void)
{
    uint8_t b[LINK_HEADER_BYTES + 64u + 4u];
    uint32_t n = 0;
    for (uint32_t i = 1; i + 1 < from_board_len && n < sizeof b; i++)
        b[n++] = from_board[i] == 0x7Du ? (uint8_t)(from_board[++i] ^ 0x20u) : from_board[i];
    if (seen_count == SEEN_MAX || n < LINK_HEADER_BYTES + 4u)
        return;
    seen[seen_count].flags = b[1];
    seen[seen_count].seq = (uint16_t)(b[2] | b[3] << 8);
    seen[seen_count].length = n - LINK_HEADER_BYTES - 4u;
    memcpy(seen[seen_count].payload, b + LINK_HEADER_BYTES, seen[seen_count].length);
    seen[seen_count].at = now;
    seen_count++;
}
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

static uint8_t sink[2u * (LINK_HEADER_BYTES + LINK_MAX_PAYLOAD + 4u) + 2u];
static uint32_t sink_len;
static void to_sink(uint8_t byte) { sink[sink_len++] = byte; }

/* The wire bytes of a frame, through the firmware's own encoder. */
static uint32_t frame_flags(uint8_t kind, uint8_t flags, uint16_t seq, uint32_t session, const void *payload,
                            uint32_t n, uint8_t *out)
{
    sink_len = 0;
    link_encode_frame(kind, flags, seq, session, payload, n, to_sink);
    memcpy(out, sink, sink_len);
    return sink_len;
}

static uint32_t frame(uint8_t kind, uint16_t seq, uint32_t session, const void *payload, uint32_t n, uint8_t *out)
{
    return frame_flags(kind, 0, seq, session, payload, n, out);
}

static void send_to_board(uint8_t kind, uint16_t seq, uint32_t session, const char *payload)
{
    uint8_t wire[512];
    uint32_t n = frame(kind, seq, session, payload, payload ? (uint32_t)strlen(payload) : 0, wire);
    queue(wire, n);
}

/* One fragment of a message: n bytes of `fill` (or of payload when given), MORE as said. */
static void send_fragment(uint16_t seq, uint32_t session, bool more, const void *payload, uint32_t n)
{
    static uint8_t wire[2u * (LINK_HEADER_BYTES + LINK_MAX_PAYLOAD + 4u) + 2u];
    uint32_t len = frame_flags(LINK_KIND_DATA, more ? LINK_FLAG_MORE : 0, seq, session, payload, n, wire);
    if (to_board_pos == to_board_len)
        to_board_pos = to_board_len = 0;  /* the board took everything before: start the buffer over */
    queue(wire, len);
}

void board_uart_putc(uint8_t byte)
{
    from_board[from_board_len++] = byte;
    /* a DATA frame just ended: the peer answers as scripted */
    if (byte == 0x7E && from_board_len > 2 && from_board[0] == 0x7E && from_board[1] == LINK_KIND_DATA) {
        transmissions++;
        note_data_frame();
        uint16_t seq = (uint16_t)(from_board[3] | from_board[4] << 8);
        uint32_t session = link_session();
        from_board_len = 0;
        if (hello_on_transmission) {
            hello_on_transmission = false;
            send_to_board(LINK_KIND_DATA, 9, 0, "hello again");
        } else if (damage_first > 0) {
            damage_first--;
            send_to_board(LINK_KIND_ACK, seq, session, NULL);
            to_board[to_board_len - 2] ^= 0x40u; /* a CRC byte hit on the line */
        } else if (repeat_first > 0) {
            repeat_first--;
            send_to_board(LINK_KIND_ACK, (uint16_t)(seq - 1u), session, NULL);
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

static bool delivered_bytes(const uint8_t *bytes, uint32_t length)
{
    uint32_t n;
    bool hello;
    const uint8_t *p = poll_payload(&n, &hello);
    bool ok = p && n == length && memcmp(p, bytes, n) == 0 && !hello;
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
    static const uint8_t golden_more[] = {0x7e, 0x01, 0x01, 0x02, 0x00, 0x78, 0x56, 0x34, 0x12, 0x7d,
                                          0x5e, 0x7d, 0x5d, 0x00, 0x41, 0xa6, 0x0f, 0x62, 0x49, 0x7e};
    check(frame_flags(LINK_KIND_DATA, LINK_FLAG_MORE, 2, 0x12345678u, payload, 4, wire) == sizeof golden_more &&
              memcmp(wire, golden_more, sizeof golden_more) == 0,
          "DATA frame with MORE equals framing.py's golden frame");

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
    check(!delivered("two", false) && link_crc_errors() == crc_before + 1 && board_sent(LINK_KIND_ACK, 1, S),
          "a frame with a bad CRC is counted and dropped; the ACK of the last DATA taken goes again");
    queue_byte(0x7E);
    queue_byte(LINK_KIND_DATA);
    queue_byte(0x7D);
    queue_byte(0x7E); /* 0x7D then 0x7E: the frame is aborted */
    check(!delivered("two", false) && board_sent(LINK_KIND_ACK, 1, S), "an aborted frame is damage too");
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

    /* ---- fragmented messages from the host ---- */
    static uint8_t big[LINK_MAX_PAYLOAD + 64u];
    for (uint32_t i = 0; i < sizeof big; i++)
        big[i] = (uint8_t)(i * 7u + 3u);
    const uint8_t *got;
    send_fragment(1, S, true, big, 1000);
    check(poll_payload(&n, &hello) == NULL && board_sent(LINK_KIND_ACK, 1, S),
          "a fragment with MORE is ACKed and not delivered");
    send_fragment(2, S, true, big + 1000, 1000);
    check(poll_payload(&n, &hello) == NULL && board_sent(LINK_KIND_ACK, 2, S), "so is the next one");
    send_fragment(2, S, true, big + 1000, 1000);
    check(poll_payload(&n, &hello) == NULL && board_sent(LINK_KIND_ACK, 2, S),
          "a fragment sent again (its ACK lost) is ACKed again and not added twice");
    send_fragment(4, S, false, big + 2500, 10);
    check(poll_payload(&n, &hello) == NULL && from_board_len == 0, "a fragment after a lost one is dropped unACKed");
    send_fragment(3, S, false, big + 2000, 500);
    got = poll_payload(&n, &hello);
    check(got && n == 2500 && memcmp(got, big, 2500) == 0 && !hello && board_sent(LINK_KIND_ACK, 3, S),
          "the last fragment (no MORE) delivers the whole message, in order");
    send_fragment(4, S, true, big, 100);  /* arrives while the board answers that message */
    link_poll(&n, &hello, &generation);
    transmissions = 0;
    ack_after = 0;
    check(link_send((const uint8_t *)"answer", 6, generation) == LINK_SENT && from_board_len == 0,
          "while that message waits unreleased, the next message's first fragment is not ACKed");
    link_release();
    send_fragment(4, S, true, big, 100);
    check(poll_payload(&n, &hello) == NULL && board_sent(LINK_KIND_ACK, 4, S), "sent again after the release, it is");
    send_fragment(5, S, false, big + 100, 1);
    got = poll_payload(&n, &hello);
    check(got && n == 101 && memcmp(got, big, 101) == 0 && board_sent(LINK_KIND_ACK, 5, S),
          "and its message arrives whole");
    link_release();

    uint32_t overflows = link_reassembly_overflows();
    send_fragment(6, S, true, big, 4000);
    send_fragment(7, S, true, big, 200);
    send_fragment(8, S, false, big, 10);
    got = poll_payload(&n, &hello);
    check(got == NULL && link_reassembly_overflows() == overflows + 1,
          "fragments adding up to more than 4096 bytes: the message is dropped and counted");
    check(from_board_len == 3u * 14u, "its fragments are ACKed all the same (the sender moves on)");
    from_board_len = 0;
    send_fragment(9, S, false, big, 7);
    check(delivered_bytes(big, 7) && board_sent(LINK_KIND_ACK, 9, S), "the next message arrives");
    send_fragment(10, S, true, big, 4000);
    send_fragment(11, S, false, big + 4000, 96);
    got = poll_payload(&n, &hello);
    check(got && n == LINK_MAX_PAYLOAD && memcmp(got, big, LINK_MAX_PAYLOAD) == 0 &&
              link_reassembly_overflows() == overflows + 1,
          "a message of exactly 4096 bytes in two fragments is delivered");
    link_release();
    from_board_len = 0;
    send_fragment(12, S, true, "partial", 7);
    link_poll(&n, &hello, &generation);
    send_to_board(LINK_KIND_DATA, 0, 0, "hello");
    check(delivered("hello", true), "a hello in the middle of a message is delivered");
    send_fragment(1, S, false, "fresh", 5);
    check(delivered("fresh", false), "and the part of the message before it is forgotten");
    from_board_len = 0;

    /* ---- fragmented messages from the board, the hello's settings ---- */
    link_configure(0, 0);
    check(link_max_fragment() == LINK_MAX_PAYLOAD && link_ack_timeout_ms() == LINK_ACK_TIMEOUT_MS,
          "0 in the hello means the defaults (4096 bytes, 100 ms)");
    link_configure(5, 100000);
    check(link_max_fragment() == LINK_MIN_FRAGMENT && link_ack_timeout_ms() == LINK_MAX_ACK_TIMEOUT_MS,
          "a fragment size below 16 and a timeout above 60 s are clamped");
    link_configure(16, 20);
    link_poll(&n, &hello, &generation);
    seen_count = 0;
    transmissions = 0;
    ack_after = 0;
    check(link_send(big, 40, generation) == LINK_SENT && seen_count == 3, "40 bytes go as 3 fragments of <= 16");
    check(seen[0].flags == LINK_FLAG_MORE && seen[1].flags == LINK_FLAG_MORE && seen[2].flags == 0 &&
              seen[0].length == 16 && seen[1].length == 16 && seen[2].length == 8 &&
              seen[1].seq == (uint16_t)(seen[0].seq + 1u) && seen[2].seq == (uint16_t)(seen[0].seq + 2u) &&
              memcmp(seen[0].payload, big, 16) == 0 && memcmp(seen[1].payload, big + 16, 16) == 0 &&
              memcmp(seen[2].payload, big + 32, 8) == 0,
          "MORE on all but the last, consecutive seqs, the message in order");
    seen_count = 0;
    check(link_send(big, 16, generation) == LINK_SENT && seen_count == 1 && seen[0].flags == 0 &&
              seen[0].length == 16, "a message of exactly one fragment has no MORE");
    seen_count = 0;
    check(link_send(big, 0, generation) == LINK_SENT && seen_count == 1 && seen[0].length == 0,
          "an empty message is one empty frame");
    seen_count = 0;
    transmissions = 0;
    ack_after = 2;
    resent = link_retransmissions();
    check(link_send(big, 10, generation) == LINK_SENT && transmissions == 3 && link_retransmissions() == resent + 2 &&
              seen[1].at - seen[0].at >= 20000u && seen[1].at - seen[0].at <= 23000u &&
              seen[2].at - seen[1].at >= 20000u && seen[2].at - seen[1].at <= 23000u,
          "with ack_timeout_ms 20 from the hello, an unACKed fragment is sent again every 20 ms");
    transmissions = 0;
    ack_after = -1;
    check(link_send(big, 40, generation) == LINK_GAVE_UP &&
              transmissions == (int)(LINK_GIVE_UP_MS / 20u) + 1,
          "a short timeout retries for LINK_GIVE_UP_MS (1000 retransmissions at 20 ms) before giving up");
    from_board_len = 0;
    send_to_board(LINK_KIND_DATA, 0, 0, "hello");
    check(delivered("hello", true) && board_sent(LINK_KIND_ACK, 0, S), "a hello starts again");

    /* ---- losses seen early: damaged frames and repeated ACKs ---- */
    link_poll(&n, &hello, &generation);
    send_fragment(1, S, false, "x", 1);
    to_board[to_board_len - 3] ^= 0x01u;
    check(poll_payload(&n, &hello) == NULL && from_board_len == 0,
          "a damaged frame right after the hello is not answered (nothing taken to ACK again)");
    send_fragment(1, S, false, "taken", 5);
    check(delivered("taken", false) && board_sent(LINK_KIND_ACK, 1, S), "seq 1 taken");
    send_fragment(2, S, false, "lost", 4);
    to_board[to_board_len - 3] ^= 0x01u;
    check(poll_payload(&n, &hello) == NULL && board_sent(LINK_KIND_ACK, 1, S),
          "a damaged frame while not sending: the ACK of the last DATA taken goes again");
    queue_byte(0x7E);
    queue_byte(0x01);
    queue_byte(0x7E);
    check(poll_payload(&n, &hello) == NULL && board_sent(LINK_KIND_ACK, 1, S), "so does a frame cut short");
    link_poll(&n, &hello, &generation);
    seen_count = 0;
    transmissions = 0;
    ack_after = 0;
    damage_first = 2;
    resent = link_retransmissions();
    check(link_send((const uint8_t *)"quick", 5, generation) == LINK_SENT && transmissions == 3 &&
              link_retransmissions() == resent + 2 && seen[2].at - seen[0].at < 10000u,
          "waiting for an ACK, a damaged frame makes the board send again at once (not after 20 ms)");
    seen_count = 0;
    transmissions = 0;
    repeat_first = 1;
    check(link_send((const uint8_t *)"again", 5, generation) == LINK_SENT && transmissions == 2 &&
              seen[1].at - seen[0].at < 5000u,
          "so does the ACK of the DATA before (the host repeats it: ours did not arrive)");
    from_board_len = 0;
    link_configure(0, 0);

    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
