"""The one way the coordinator's request handlers refuse a call: a gRPC status and a message naming the problem
and its fix. Service and calibration raise it; the servicers turn it into the call's status."""

from __future__ import annotations

import grpc

__all__ = ["Refused"]


class Refused(Exception):
    """Abort the call with ``code`` and ``message`` (a problem and its fix)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
