"""Mutual TLS: `poet certs` makes the CA and bundles; a real gRPC server on loopback learns who calls from them."""

from __future__ import annotations

import stat
from concurrent import futures

import grpc
import pytest
from cryptography import x509

from host.fleet import certs
from tests.host.cli.helpers import one_json_object, poet

WHOAMI = "/poet.test.Identity/WhoAmI"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}, encoded by hand
CALL_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    """The real commands, as an operator runs them."""
    root = tmp_path_factory.mktemp("certs") / "fleet"
    for argv in (("init", "--dir", str(root), "--host", "coordinator.example", "--host", "10.1.2.3"),
                 ("issue", "--dir", str(root), "--node", "pi-1"),
                 ("issue", "--dir", str(root), "--operator", "alice")):
        run = poet("certs", *argv, timeout=60)
        assert run.returncode == 0, run.stderr
    return root


class _Identity(grpc.GenericRpcHandler):
    """grpc.health.v1 Check (always SERVING) and WhoAmI, which answers "ROLE/NAME" from the caller's certificate."""

    def service(self, handler_call_details):
        if handler_call_details.method == HEALTH_CHECK:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: SERVING)
        if handler_call_details.method == WHOAMI:
            return grpc.unary_unary_rpc_method_handler(self._whoami)
        return None

    @staticmethod
    def _whoami(request, context):
        try:
            role, name = certs.peer_identity(context.auth_context())
        except certs.IdentityError as error:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        return f"{role}/{name}".encode()


@pytest.fixture(scope="module")
def server_port(cert_dir):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[_Identity()])
    port = server.add_secure_port("127.0.0.1:0", certs.server_credentials(cert_dir / "coordinator"))
    server.start()
    yield port
    server.stop(grace=None)


def _call(channel: grpc.Channel, method: str) -> bytes:
    return channel.unary_unary(method)(b"", timeout=CALL_TIMEOUT_S)


def _whoami(port: int, credentials) -> bytes:
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return _call(channel, WHOAMI)


def _refused(port: int, credentials) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _whoami(port, credentials)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value  # the handshake, not the handler
    return refused.value


# ------------------------------------------------------------------------------------------ files
def test_init_and_issue_write_bundles_with_private_keys_and_identities(cert_dir):
    assert stat.S_IMODE((cert_dir / "ca.key").stat().st_mode) == 0o600
    for name, role in (("coordinator", "coordinator"), ("pi-1", "node"), ("alice", "operator")):
        bundle = cert_dir / name
        assert sorted(p.name for p in bundle.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
        assert stat.S_IMODE((bundle / "key.pem").stat().st_mode) == 0o600
        assert (bundle / "ca.pem").read_bytes() == (cert_dir / "ca.pem").read_bytes()
        assert certs.certificate_identity((bundle / "cert.pem").read_bytes()) == (role, name)
    coordinator = x509.load_pem_x509_certificate((cert_dir / "coordinator/cert.pem").read_bytes())
    sans = coordinator.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "coordinator.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]
    node = x509.load_pem_x509_certificate((cert_dir / "pi-1/cert.pem").read_bytes())
    assert node.subject.rfc4514_string() == "CN=pi-1"
    assert node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier) == ["poet://node/pi-1"]


def test_issue_refuses_a_bad_name_with_a_clear_error(cert_dir):
    # A failing `poet` costs seconds (its error path imports torch), so one bad name goes through the command
    # and the rest through issue_cert below.
    run = poet("certs", "issue", "--dir", str(cert_dir), "--node", "../evil", timeout=60)
    assert run.returncode == 2, run.stderr
    assert "certificate name '../evil' may hold only" in run.stderr and "Traceback" not in run.stderr
    assert not (cert_dir.parent / "evil").exists()


@pytest.mark.parametrize(("name", "why"), [
    ("../evil", "may hold only"), ("a/b", "may hold only"), ("a\\b", "may hold only"), (".hidden", "may hold only"),
    ("two words", "may hold only"), ("", "must not be empty"), ("x" * 64, "at most 63"),
    ("coordinator", "coordinator's own certificate"), ("ca.pem", "is a file"),
])
def test_issue_refuses_bad_names(cert_dir, name, why):
    before = sorted(p.name for p in cert_dir.iterdir())
    with pytest.raises(certs.CertError, match=why):
        certs.issue_cert(cert_dir, name, "operator", force=True)
    assert sorted(p.name for p in cert_dir.iterdir()) == before
    with pytest.raises(certs.CertError, match="role must be one of"):
        certs.issue_cert(cert_dir, "pi-9", "admin")


@pytest.mark.slow  # 7 s of key generation; the fast suite keeps its 5-minute margin
def test_an_existing_ca_or_bundle_is_kept_without_force(tmp_path):
    root = tmp_path / "fleet"
    assert poet("certs", "init", "--dir", str(root), timeout=60).returncode == 0
    ca_before = (root / "ca.pem").read_bytes()
    again = poet("certs", "init", "--dir", str(root), timeout=60)
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert (root / "ca.pem").read_bytes() == ca_before

    issued = poet("certs", "issue", "--dir", str(root), "--node", "pi-2", "--json", timeout=60)
    assert issued.returncode == 0, issued.stderr
    assert one_json_object(issued.stdout)["bundle_dir"] == str(root / "pi-2")
    cert_before = (root / "pi-2/cert.pem").read_bytes()
    with pytest.raises(certs.CertError, match="--force"):
        certs.issue_cert(root, "pi-2", "node")
    assert (root / "pi-2/cert.pem").read_bytes() == cert_before

    forced = poet("certs", "init", "--dir", str(root), "--force", timeout=60)
    assert forced.returncode == 0, forced.stderr
    assert (root / "ca.pem").read_bytes() != ca_before


def test_issue_without_a_ca_says_to_run_init(tmp_path):
    with pytest.raises(certs.CertError, match="poet certs init"):
        certs.issue_cert(tmp_path, "bob", "operator")


# ------------------------------------------------------------------------------------------ over gRPC
def test_the_server_is_healthy_over_mutual_tls(cert_dir, server_port):
    with grpc.secure_channel(f"127.0.0.1:{server_port}", certs.channel_credentials(cert_dir / "pi-1")) as channel:
        assert _call(channel, HEALTH_CHECK) == SERVING


def test_a_node_and_an_operator_are_known_by_their_certificates(cert_dir, server_port):
    assert _whoami(server_port, certs.channel_credentials(cert_dir / "pi-1")) == b"node/pi-1"
    assert _whoami(server_port, certs.channel_credentials(cert_dir / "alice")) == b"operator/alice"


def test_a_plaintext_client_is_refused(cert_dir, server_port):
    with grpc.insecure_channel(f"127.0.0.1:{server_port}") as channel, pytest.raises(grpc.RpcError) as refused:
        _call(channel, WHOAMI)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_is_refused(cert_dir, server_port):
    _refused(server_port, grpc.ssl_channel_credentials(root_certificates=(cert_dir / "ca.pem").read_bytes()))


def test_a_certificate_from_another_ca_is_refused(cert_dir, server_port, tmp_path):
    certs.init_certs(tmp_path)
    certs.issue_cert(tmp_path, "pi-1", "node")  # same name and role, wrong CA
    impostor = certs.load_bundle(tmp_path / "pi-1")
    trusting_our_ca = grpc.ssl_channel_credentials(root_certificates=(cert_dir / "ca.pem").read_bytes(),
                                                   private_key=impostor.key_pem, certificate_chain=impostor.cert_pem)
    _refused(server_port, trusting_our_ca)


def test_an_expired_certificate_is_refused(cert_dir, server_port):
    certs.issue_cert(cert_dir, "pi-expired", "node", valid_days=-1)
    expired = x509.load_pem_x509_certificate((cert_dir / "pi-expired/cert.pem").read_bytes())
    assert expired.not_valid_after_utc < certs._now()
    _refused(server_port, certs.channel_credentials(cert_dir / "pi-expired"))
    assert _whoami(server_port, certs.channel_credentials(cert_dir / "pi-1")) == b"node/pi-1"  # the server is fine


def test_peer_identity_refuses_a_context_without_a_client_certificate(cert_dir):
    with pytest.raises(certs.IdentityError, match="no verified client certificate"):
        certs.peer_identity({"transport_security_type": [b"ssl"]})
    pem = (cert_dir / "alice/cert.pem").read_bytes()
    assert certs.peer_identity({"x509_pem_cert": [pem]}) == ("operator", "alice")
    with pytest.raises(certs.IdentityError, match="no subject alternative names"):
        certs.certificate_identity((cert_dir / "ca.pem").read_bytes())  # a certificate that names no one
