"""Who is calling: the (role, name) of the caller's mutual-TLS certificate, never a message field.

The wrong role and removed nodes are refused with PERMISSION_DENIED, naming the bundle to use instead.
"""

from __future__ import annotations

import grpc

from host.fleet.certs import IdentityError, peer_identity
from host.fleet.refusal import Refused
from host.fleet.store import RunStore

NODE, OPERATOR = "node", "operator"


class Authorizer:
    """Identifies callers against the store's registry (removed nodes)."""

    def __init__(self, store: RunStore):
        self.store = store

    def caller(self, context, role: str) -> str:
        """The caller's name, if its certificate has ``role`` (and, for a node, it was not removed)."""
        try:
            caller_role, name = peer_identity(context.auth_context())
        except IdentityError as error:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"{error}; connect with a bundle from `poet certs issue`") from None
        if caller_role != role:
            if role == NODE:
                fix = "the Fleet service is for boards: run `poet-agent run` with a node bundle (`poet certs issue --node NAME`)"
            else:
                fix = ("the FleetAdmin service is for operators: use a bundle from `poet certs issue --operator NAME` "
                       "(POET_CERTS or --certs)")
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{caller_role} {name!r} may not call this: {fix}")
        if role == NODE and self.store.is_removed(name):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"node {name!r} was removed with `poet fleet remove` and is refused; issue a certificate "
                           f"under a new name (`poet certs issue --node NEW_NAME`) to bring the board back")
        return name
