"""The host's side of a microcontroller's serial link: framing, reliable messages, a noisy-line proxy, QEMU."""
