/* The serial link (device_agent/serial_bridge/framing.py and link.py are the host's side).
 *
 * Frame: 0x7E, escape(body), 0x7E, where 0x7E and 0x7D in the body travel as 0x7D, byte ^ 0x20;
 * empty frames are ignored and 0x7D followed by 0x7E aborts a frame.
 * body = kind u8 | flags u8 | seq u16 LE | session_id u32 LE | payload | crc32 u32 LE (zlib's
 * CRC-32 over everything before it). kind 1 DATA, 2 ACK (no payload, seq = the DATA's seq).
 * flags bit 0 (MORE): the message goes on in the next DATA frame. A message is consecutive DATA
 * frames, MORE on all but the last, at most LINK_MAX_PAYLOAD bytes in all; each frame is its own
 * stop-and-wait unit and only whole messages are delivered (a message over the limit is dropped and
 * counted). The board sends fragments of at most link_max_fragment() bytes. A hello is one frame.
 * A damaged frame (bad CRC, short, aborted) is a loss seen early: waiting for an ACK, the board sends
 * its DATA again at once; otherwise it repeats the ACK of the last DATA taken, and an ACK of the seq
 * before the one it waits for makes it send again at once (link.py does the same).
 * Stop-and-wait per direction. The board draws a nonzero session id at boot and puts it on every
 * frame; a DATA frame with session 0 is a hello, which resets both sequences. DATA of another
 * session is not delivered; its ACK carries this boot's session, which tells the host of the reboot. */
#ifndef POET_LINK_H
#define POET_LINK_H

#include <stdbool.h>
#include <stdint.h>

#define LINK_MAX_PAYLOAD 4096u
#define LINK_HEADER_BYTES 8u
#define LINK_ACK_TIMEOUT_MS 100u   /* the default; a hello may set another (link_configure) */
#define LINK_MIN_FRAGMENT 16u
#define LINK_MAX_ACK_TIMEOUT_MS 60000u
#define LINK_MAX_RETRIES 200u      /* at least; then the board waits for a new hello */
#define LINK_GIVE_UP_MS 20000u     /* with a short timeout, retries go on for this long (200 x 100 ms) */

enum { LINK_KIND_DATA = 1, LINK_KIND_ACK = 2 };
enum { LINK_FLAG_MORE = 1 };

typedef enum {
    LINK_SENT = 0,     /* acknowledged */
    LINK_RESET = 1,    /* a hello arrived: the reply belongs to an earlier conversation */
    LINK_GAVE_UP = 2,  /* never acknowledged; the board now waits for a hello */
} link_send_result_t;

void link_init(uint32_t session_id);
uint32_t link_session(void);
/* Read what the UART holds; return the next delivered message (valid until link_release()) or NULL.
 * *generation counts hellos: a reply to a message must be sent with its generation. */
const uint8_t *link_poll(uint32_t *length, bool *is_hello, uint32_t *generation);
void link_release(void);
/* Send one message (in fragments of link_max_fragment() bytes), each fragment until ACKed. */
link_send_result_t link_send(const uint8_t *payload, uint32_t length, uint32_t generation);

/* The hello's link settings: 0 = the default (LINK_MAX_PAYLOAD, LINK_ACK_TIMEOUT_MS); fragments are
 * clamped to LINK_MIN_FRAGMENT..LINK_MAX_PAYLOAD, timeouts to 1..LINK_MAX_ACK_TIMEOUT_MS. */
void link_configure(uint32_t max_fragment_bytes, uint32_t ack_timeout_ms);
uint32_t link_max_fragment(void);
uint32_t link_ack_timeout_ms(void);

uint32_t link_crc_errors(void);
uint32_t link_retransmissions(void);
uint32_t link_reassembly_overflows(void);

/* Frame bytes for a body (tests and the board's own use): returns the encoded length. */
uint32_t link_encode_frame(uint8_t kind, uint8_t flags, uint16_t seq, uint32_t session, const uint8_t *payload,
                           uint32_t length, void (*emit)(uint8_t byte));

#endif
