"""A party's mutual-TLS bundle (ca.pem, cert.pem, key.pem) and the gRPC credentials made from it.

The board needs no certificate tooling: gRPC's BoringSSL reads the PEM files itself. The host's
certificate tooling (``host/fleet/certs.py``, which makes the bundles) imports these, so loading a
bundle is written once, for the coordinator, the operators and the agents.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUNDLE_FILES", "Bundle", "CertError", "channel_credentials", "load_bundle"]

BUNDLE_FILES = ("ca.pem", "cert.pem", "key.pem")


class CertError(ValueError):
    """A certificate request that cannot be honoured; the message names the problem and the fix."""


@dataclass(frozen=True)
class Bundle:
    """One party's PEM files: the CA to trust, its own certificate and its private key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def load_bundle(bundle_dir: str | os.PathLike) -> Bundle:
    """The PEM files of a bundle directory (what `poet certs init` or `poet certs issue` wrote)."""
    root = Path(bundle_dir)
    if not root.is_dir():
        raise CertError(f"certificate bundle {root} does not exist or is not a directory (make one on the "
                        "operator's machine with `poet certs issue --dir DIR --node NAME` and copy DIR/NAME here)")
    missing = [f for f in BUNDLE_FILES if not (root / f).is_file()]
    if missing:
        raise CertError(f"{root} is not a certificate bundle: {', '.join(missing)} missing (a board's bundle comes "
                        "from `poet certs issue --dir DIR --node NAME`, the coordinator's from `poet certs init`)")
    contents = []
    for name in BUNDLE_FILES:
        try:
            data = (root / name).read_bytes()
        except OSError as exc:
            raise CertError(f"cannot read {root / name}: {exc.strerror or exc}") from None
        if b"-----BEGIN " not in data:
            raise CertError(f"{root / name} is not a PEM file (no -----BEGIN line); issue the bundle again with "
                            "`poet certs issue --dir DIR --node NAME --force`")
        contents.append(data)
    return Bundle(*contents)


def channel_credentials(bundle_dir: str | os.PathLike):
    """gRPC channel credentials presenting the bundle's certificate and trusting only its CA."""
    import grpc

    bundle = load_bundle(bundle_dir)
    return grpc.ssl_channel_credentials(root_certificates=bundle.ca_pem, private_key=bundle.key_pem,
                                        certificate_chain=bundle.cert_pem)
