"""The operator's client of the coordinator's FleetAdmin service: a mutual-TLS channel, its stubs, and the calls that
take more than one RPC (every page of a list, a model's upload). No argparse here: the CLI (host/cli) and scripts
build it from an address and an operator bundle.

``poet run --model module:callable`` runs the operator's code here, on the operator's side: :meth:`submit_model`
traces it (:func:`host.fleet.model_package.package_model`), uploads the archive content-addressed and resumable
(StatModel, then UploadModel from what the coordinator holds), and submits its digest with the grouping and the
graph. The coordinator never imports it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from host.fleet.limits import MAX_MESSAGE_BYTES

COORDINATOR_ENV, CERTS_ENV = "POET_COORDINATOR", "POET_CERTS"
CALL_TIMEOUT_S = 30.0
SUBMIT_TIMEOUT_S = 900.0  # one solve per distinct board (each bounded by the coordinator's limit)
UPLOAD_TIMEOUT_S = 900.0
UPLOAD_ATTEMPTS = 3  # an upload that breaks resumes from what the coordinator holds, this many times at most


class FleetClientError(Exception):
    """A call the coordinator refused or could not answer; the message names the problem and the fix."""

    def __init__(self, message: str, code: Any = None):
        super().__init__(message)
        self.code = code  # grpc.StatusCode, when a call failed


def is_traced_locally(model: str) -> bool:
    """True for a ``module:callable`` (the operator's code: traced and uploaded by the client); zoo names and
    ``poet2022:`` reference graphs are resolved by the coordinator."""
    from host.graph.resolve import POET2022_PREFIX

    return ":" in model and not model.startswith(POET2022_PREFIX)


class OperatorClient:
    """FleetAdmin over a mutual-TLS channel to ``target`` with the operator bundle in ``certs``."""

    def __init__(self, target: str, certs: str | os.PathLike):
        import grpc

        from device_agent import protos
        from host.fleet.certs import CertError, channel_credentials

        self.target = target
        try:
            credentials = channel_credentials(certs)
        except CertError as error:
            raise FleetClientError(str(error)) from None
        self.pb = protos.load("poet.v1.fleet_pb2")
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.secure_channel(target, credentials, options=options)
        self.stub = protos.load("poet.v1.fleet_pb2_grpc").FleetAdminStub(self.channel)

    @classmethod
    def from_settings(cls, target: str | None = None, certs: str | os.PathLike | None = None) -> OperatorClient:
        """The client for ``target`` and ``certs``, each defaulting to its environment variable."""
        target = target or os.environ.get(COORDINATOR_ENV)
        certs = certs or os.environ.get(CERTS_ENV)
        missing = [f"--coordinator HOST:PORT (or {COORDINATOR_ENV})" if not target else None,
                   f"--certs DIR, an operator bundle from `poet certs issue --operator NAME` (or {CERTS_ENV})"
                   if not certs else None]
        missing = [m for m in missing if m]
        if missing:
            raise FleetClientError(f"where is the coordinator? give {' and '.join(missing)}")
        return cls(target, certs)

    def __enter__(self) -> OperatorClient:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    # ------------------------------------------------------------------------------------------ calls
    def call(self, method: str, request, timeout_s: float = CALL_TIMEOUT_S):
        import grpc

        try:
            return getattr(self.stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as error:
            raise FleetClientError(self.explain(error), error.code()) from None

    def call_pages(self, method: str, request, field: str) -> list:
        """Every entry of a paged list call (``field`` of each reply), page after page."""
        entries: list = []
        while True:
            reply = self.call(method, request)
            entries.extend(getattr(reply, field))
            if not reply.next_page_token:
                return entries
            request.page_token = reply.next_page_token

    def explain(self, error) -> str:
        import grpc

        code, details = error.code(), (error.details() or "").strip()
        if code == grpc.StatusCode.UNAVAILABLE:
            return (f"coordinator not reachable at {self.target} ({details}); is `poet serve` running there, and "
                    f"is --coordinator/{COORDINATOR_ENV} right?")
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return f"refused by the coordinator: {details}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"the coordinator at {self.target} did not answer in time; try again (or check its log)"
        return details or f"the coordinator answered {code.name}"

    # ------------------------------------------------------------------------------------------ models
    def upload_archive(self, digest: str, path: str | os.PathLike, log: Callable[[str], None] = lambda _m: None):
        """Make the coordinator hold the archive ``path`` (sha256 ``digest``): nothing is sent when it already does;
        an upload that breaks resumes from what it holds."""
        import grpc

        from host.fleet.uploads import upload_chunks

        size = Path(path).stat().st_size
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            state = self.call("StatModel", self.pb.StatModelRequest(digest=digest))
            if state.stored:
                return
            if size > state.max_size_bytes:
                raise FleetClientError(f"the model's archive is {size} bytes; the coordinator takes at most "
                                       f"{state.max_size_bytes}: train a smaller model")
            log(f"uploading model {digest[:12]} ({size - state.received_bytes} of {size} bytes)")
            try:
                reply = self.stub.UploadModel(upload_chunks(digest, path, state.received_bytes),
                                              timeout=UPLOAD_TIMEOUT_S)
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED) \
                        or attempt == UPLOAD_ATTEMPTS:
                    raise FleetClientError(self.explain(error), error.code()) from None
                continue
            if reply.stored:
                return
        raise FleetClientError(f"the upload of model {digest[:12]} did not complete after {UPLOAD_ATTEMPTS} attempts")

    def upload_model(self, package, log: Callable[[str], None] = lambda _m: None):
        """Upload a traced ModelPackage; the poet.v1.UploadedModel a SubmitRunRequest names it by."""
        import json

        self.upload_archive(package.digest, package.path, log)
        return self.pb.UploadedModel(digest=package.digest, grouping=package.grouping,
                                     graph_json=json.dumps(package.graph.to_dict()), batch_size=package.batch_size)

    def submit(self, request, log: Callable[[str], None] = lambda _m: None):
        """SubmitRun; a ``module:callable`` model is traced here and uploaded first. The reply's runs."""
        if (request.model and is_traced_locally(request.model) and not request.HasField("uploaded_model")
                and request.kind != self.pb.JOB_KIND_PROFILE):  # a PROFILE job runs no model
            from host.fleet.model_package import package_model
            from host.run.errors import UserError

            log(f"tracing {request.model} here (the coordinator never runs your code)")
            with tempfile.TemporaryDirectory(prefix="poet-upload-") as scratch:
                try:
                    package = package_model(request.model, scratch, batch_size=request.batch_size or None,
                                            granularity=request.granularity or "layer",
                                            seed=request.seed)
                except UserError as error:
                    raise FleetClientError(str(error).strip("'\"")) from None
                request.uploaded_model.CopyFrom(self.upload_model(package, log))
        return list(self.call("SubmitRun", request, timeout_s=SUBMIT_TIMEOUT_S).runs)
