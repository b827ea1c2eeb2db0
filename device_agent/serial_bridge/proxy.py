"""A TCP proxy that corrupts and drops bytes, to test the link over a noisy line (QEMU's UART never errs).

Each byte is dropped with ``drop_probability``, else XORed with a random nonzero byte with ``corrupt_probability``.
"""
from __future__ import annotations

import math
import random
import socket
import threading

__all__ = ["FaultProxy"]

_CHUNK_BYTES = 65536


class _Faults:
    """The fault process of one direction: skips geometric gaps between faulty bytes instead of a draw per byte."""

    def __init__(self, corrupt_probability: float, drop_probability: float, seed: int) -> None:
        self._rng = random.Random(seed)
        self._fault_probability = drop_probability + (1.0 - drop_probability) * corrupt_probability
        self._drop_share = drop_probability / self._fault_probability if self._fault_probability else 0.0
        self._until_fault = self._gap()

    def _gap(self) -> int:
        """Clean bytes before the next faulty one (geometric with the per-byte fault probability)."""
        if self._fault_probability <= 0.0:
            return -1  # never
        u = 1.0 - self._rng.random()  # in (0, 1]
        return int(math.log(u) / math.log1p(-self._fault_probability))

    def apply(self, data: bytes) -> tuple[bytes, int, int]:
        """``data`` after the faults that fall in it, with the numbers of bytes corrupted and dropped."""
        if self._until_fault < 0 or self._until_fault >= len(data):
            if self._until_fault >= 0:
                self._until_fault -= len(data)
            return data, 0, 0
        out = bytearray()
        corrupted = dropped = 0
        position = 0
        while 0 <= self._until_fault < len(data) - position:
            at = position + self._until_fault
            out += data[position:at]
            if self._rng.random() < self._drop_share:
                dropped += 1
            else:
                out.append(data[at] ^ self._rng.randrange(1, 256))
                corrupted += 1
            position = at + 1
            self._until_fault = self._gap()
        out += data[position:]
        if self._until_fault >= 0:
            self._until_fault -= len(data) - position
        return bytes(out), corrupted, dropped


class FaultProxy:
    """Relays TCP connections from ``127.0.0.1:.port`` to the target, corrupting and dropping bytes on the way.

    Each direction has its own generator seeded from ``seed``: which stream positions are hit ignores thread timing."""

    def __init__(self, target_host: str, target_port: int, *, corrupt_probability: float,
                 drop_probability: float | None = None, seed: int = 0) -> None:
        for label, value in (("corrupt_probability", corrupt_probability), ("drop_probability", drop_probability)):
            if value is None and label == "drop_probability":
                continue
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise ValueError(f"{label} is a per-byte probability in [0, 1), not {value!r}")
        if drop_probability is None:
            drop_probability = corrupt_probability / 10
        self.target = (target_host, int(target_port))
        self.corrupt_probability = float(corrupt_probability)
        self.drop_probability = float(drop_probability)
        self.seed = int(seed)
        self.bytes_forwarded = 0  # bytes written out, after drops
        self.bytes_corrupted = 0
        self.bytes_dropped = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the target is not listening: the client sees the connection close
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # relay frames as they come
            with self._lock:
                if self._closing.is_set():
                    client.close()
                    upstream.close()
                    return
                index = self.connections
                self.connections += 1
                self._sockets += [client, upstream]
                for direction, (source, sink) in enumerate(((client, upstream), (upstream, client))):
                    faults = _Faults(self.corrupt_probability, self.drop_probability,
                                     self.seed * 1_000_003 + 2 * index + direction)
                    thread = threading.Thread(target=self._pump, args=(source, sink, faults), daemon=True,
                                              name=f"fault-proxy-{self.port}-{index}-{direction}")
                    self._threads.append(thread)
                    thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, faults: _Faults) -> None:
        """Copy one direction until either side closes, then close the other side's writing half."""
        try:
            while True:
                data = source.recv(_CHUNK_BYTES)
                if not data:
                    break
                data, corrupted, dropped = faults.apply(data)
                if data:
                    sink.sendall(data)
                with self._lock:
                    self.bytes_forwarded += len(data)
                    self.bytes_corrupted += corrupted
                    self.bytes_dropped += dropped
        except OSError:
            pass
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening, cut every relayed connection and wait for the threads (idempotent)."""
        self._closing.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() (close alone does not, on Linux)
        except OSError:
            pass
        self._listener.close()
        self._accepter.join(timeout=5)
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout=5)
        for sock in sockets:
            sock.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
