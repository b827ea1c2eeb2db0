"""Certificates for the fleet's mutual TLS: a private CA, the coordinator's certificate, node and operator ones.

Identity lives in the certificate, never in a message field. A certificate names its holder twice:
its subject CN is the name, and a single URI subject alternative name ``poet://ROLE/NAME`` states
the role (``node`` or ``operator``; the coordinator's is ``poet://coordinator/coordinator``). The
coordinator reads both from ``grpc.ServicerContext.auth_context()`` with :func:`peer_identity`, which
trusts them only because gRPC has already verified the chain against our CA.

Layout of a certificate directory (what ``poet certs init`` and ``poet certs issue`` write)::

    DIR/ca.pem  DIR/ca.key (0600)              the CA; ca.key never leaves the operator's machine
    DIR/coordinator/{ca.pem,cert.pem,key.pem}  for `poet serve --certs DIR/coordinator`
    DIR/NAME/{ca.pem,cert.pem,key.pem}         a node's or an operator's bundle (key.pem 0600)

Keys are ECDSA P-256: small, fast to make on a Pi, and accepted by gRPC's BoringSSL.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Loading a bundle is shared with the board, which has no `cryptography`: it lives in the agent's package.
from device_agent.agent.credentials import BUNDLE_FILES, Bundle, CertError, channel_credentials, load_bundle
from device_agent.fileio import atomic_write_bytes

__all__ = ["BUNDLE_FILES", "Bundle", "CertError", "IdentityError", "certificate_identity", "channel_credentials",
           "check_name", "identity_uri", "init_certs", "issue_cert", "load_bundle", "peer_identity",
           "server_credentials"]

ROLES = ("node", "operator")
COORDINATOR = "coordinator"  # the coordinator's bundle directory, name and role
URI_SCHEME = "poet"
CA_VALID_DAYS = 3650
DEFAULT_VALID_DAYS = 825  # the CA/Browser Forum's former ceiling for leaf certificates
MAX_NAME_CHARS = 63  # a DNS label: names often double as host names
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CLOCK_SKEW = dt.timedelta(minutes=5)  # not-before is back-dated so a board with a slow clock accepts it

CA_CERT, CA_KEY = "ca.pem", "ca.key"


class IdentityError(PermissionError):
    """A peer whose certificate does not carry a poet identity."""


def check_name(name: str) -> str:
    """A node's or operator's name: also a directory name, so no separators, dots-only or hidden names."""
    if not isinstance(name, str) or not name:
        raise CertError("a certificate name must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise CertError(f"certificate name {name[:20]!r}... is {len(name)} characters; at most {MAX_NAME_CHARS}")
    if not _NAME.fullmatch(name):
        raise CertError(f"certificate name {name!r} may hold only letters, digits, '.', '_' and '-' and must start "
                        "with a letter or digit (no path separators, spaces or leading dots)")
    if name == COORDINATOR:
        raise CertError(f"{COORDINATOR!r} is the coordinator's own certificate; pick another name")
    return name


def identity_uri(role: str, name: str) -> str:
    return f"{URI_SCHEME}://{role}/{name}"


def init_certs(directory: str | os.PathLike, hosts: list[str] | tuple[str, ...] = (), *, force: bool = False,
               valid_days: int = DEFAULT_VALID_DAYS) -> Path:
    """Create the CA in ``directory`` and the coordinator's bundle; returns the bundle directory.

    The coordinator's certificate names localhost, 127.0.0.1 and each of ``hosts`` (host names or IP
    addresses agents dial). An existing CA is never replaced unless ``force``: every certificate it
    signed would stop working.
    """
    root = Path(directory)
    hosts = [_check_host(h) for h in hosts]
    existing = [root / f for f in (CA_CERT, CA_KEY) if (root / f).exists()]
    if existing and not force:
        raise CertError(f"{root} already holds a CA ({', '.join(p.name for p in existing)}); replacing it "
                        "invalidates every certificate it signed: pass --force to do it anyway")
    root.mkdir(parents=True, exist_ok=True)
    now = _now()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "poet-edge fleet CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + dt.timedelta(days=CA_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    atomic_write_bytes(root / CA_KEY, _key_pem(ca_key), mode=0o600)
    atomic_write_bytes(root / CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM))
    sans: list[x509.GeneralName] = []
    for host in ["localhost", "127.0.0.1", *hosts]:
        general = _host_name(host)
        if general not in sans:
            sans.append(general)
    return _issue(root, COORDINATOR, COORDINATOR, sans, server=True, valid_days=valid_days, force=True)


def issue_cert(directory: str | os.PathLike, name: str, role: str, *, valid_days: int = DEFAULT_VALID_DAYS,
               force: bool = False) -> Path:
    """Write the bundle ``directory/name/`` for a node or an operator, signed by the CA in ``directory``.

    ``valid_days`` may be negative (an already expired certificate, for tests of refusal).
    An existing bundle is kept unless ``force``.
    """
    if role not in ROLES:
        raise CertError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    check_name(name)
    return _issue(Path(directory), name, role, [], server=False, valid_days=valid_days, force=force)


def server_credentials(bundle_dir: str | os.PathLike):
    """gRPC server credentials that require a client certificate signed by the bundle's CA."""
    import grpc

    bundle = load_bundle(bundle_dir)
    return grpc.ssl_server_credentials([(bundle.key_pem, bundle.cert_pem)], root_certificates=bundle.ca_pem,
                                       require_client_auth=True)


def certificate_identity(cert_pem: bytes) -> tuple[str, str]:
    """(role, name) from a certificate: its one ``poet://ROLE/NAME`` URI, which must agree with its CN."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise IdentityError("the certificate has no subject alternative names (not made by `poet certs`)") from None
    uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(f"{URI_SCHEME}://")]
    if len(uris) != 1:
        raise IdentityError(f"the certificate carries {len(uris)} poet:// identities; exactly one is required")
    role, _, name = uris[0][len(URI_SCHEME) + 3:].partition("/")
    common_names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if role not in (*ROLES, COORDINATOR) or not name or common_names != [name]:
        raise IdentityError(f"the certificate's identity {uris[0]!r} does not match its subject {common_names}")
    return role, name


def peer_identity(auth_context: dict[str, list[bytes]]) -> tuple[str, str]:
    """(role, name) of the caller, from ``context.auth_context()`` of a mutual-TLS gRPC call.

    gRPC has verified the peer's chain against our CA before the handler runs; a call without a
    verified client certificate has no ``x509_pem_cert`` and is refused here too.
    """
    pems = auth_context.get("x509_pem_cert") or []
    if len(pems) != 1:
        raise IdentityError("the caller presented no verified client certificate")
    return certificate_identity(pems[0])


# ------------------------------------------------------------------------------------------ internals
def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _check_host(host: str) -> str:
    if not host or len(host) > 253 or not re.fullmatch(r"[A-Za-z0-9.:_-]+", host):
        raise CertError(f"--host {host!r} is not a host name or an IP address")
    return host


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _load_ca(root: Path):
    if not (root / CA_CERT).is_file() or not (root / CA_KEY).is_file():
        raise CertError(f"no CA in {root} ({CA_CERT} and {CA_KEY}): run `poet certs init --dir {root}` first")
    ca_cert = x509.load_pem_x509_certificate((root / CA_CERT).read_bytes())
    ca_key = serialization.load_pem_private_key((root / CA_KEY).read_bytes(), password=None)
    return ca_cert, ca_key


def _issue(root: Path, name: str, role: str, sans: list[x509.GeneralName], *, server: bool, valid_days: int,
           force: bool) -> Path:
    ca_cert, ca_key = _load_ca(root)
    bundle_dir = root / name
    if bundle_dir.exists() and not bundle_dir.is_dir():
        raise CertError(f"{bundle_dir} is a file (the CA's own?); pick another name")
    if bundle_dir.exists() and not force:
        raise CertError(f"{bundle_dir} already exists; pass --force to issue a new certificate for {name!r}")
    now = _now()
    not_after = now + dt.timedelta(days=valid_days)
    not_before = min(now - _CLOCK_SKEW, not_after - dt.timedelta(days=1))
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName([*sans, x509.UniformResourceIdentifier(identity_uri(role, name))]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    bundle_dir.mkdir(exist_ok=True)
    atomic_write_bytes(bundle_dir / "key.pem", _key_pem(key), mode=0o600)
    atomic_write_bytes(bundle_dir / "cert.pem", cert.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(bundle_dir / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    return bundle_dir
