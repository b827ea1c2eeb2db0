/* The serial link (device_agent/serial_bridge/framing.py and link.py are the host's side).
 *
 * Frame: 0x7E, escape(body), 0x7E, where 0x7E and 0x7D in the body travel as 0x7D, byte ^ 0x20;
 * empty frames are ignored and 0x7D followed by 0x7E aborts a frame.
 * body = kind u8 | flags u8 (0) | seq u16 LE | session_id u32 LE | payload | crc32 u32 LE (zlib's
 * CRC-32 over everything before it). kind 1 DATA, 2 ACK (no payload, seq = the DATA's seq).
 * Stop-and-wait per direction. The board draws a nonzero session id at boot and puts it on every
 * frame; a DATA frame with session 0 is a hello, which resets both sequences. DATA of another
 * session is not delivered; its ACK carries this boot's session, which tells the host of the reboot. */
#ifndef POET_LINK_H
#define POET_LINK_H

#include <stdbool.h>
#include <stdint.h>

#define LINK_MAX_PAYLOAD 4096u
#define LINK_HEADER_BYTES 8u
#define LINK_ACK_TIMEOUT_MS 100u
#define LINK_MAX_RETRIES 200u  /* then the board waits for a new hello */

enum { LINK_KIND_DATA = 1, LINK_KIND_ACK = 2 };

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
link_send_result_t link_send(const uint8_t *payload, uint32_t length, uint32_t generation);

uint32_t link_crc_errors(void);
uint32_t link_retransmissions(void);

/* Frame bytes for a body (tests and the board's own use): returns the encoded length. */
uint32_t link_encode_frame(uint8_t kind, uint16_t seq, uint32_t session, const uint8_t *payload, uint32_t length,
                           void (*emit)(uint8_t byte));

#endif
