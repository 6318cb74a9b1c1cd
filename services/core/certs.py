"""A deployment's own certificate authority: ``rlfabric certs OUT_DIR --hosts h1,h2`` and ``up --tls auto``.

One private CA signs two certificates: the services' (every host a client dials, as a subject alternative name;
server and client use, since services call each other and present it under mTLS) and the clients' (the CLI,
notebooks). Private keys are written owner-only. The CA's key signs nothing else afterwards: keep it offline.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path

from rlfabric.services.core.auth import AuthError, TLSFiles, write_private_file

FILES = ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def local_hosts(host: str = "") -> list[str]:
    """The names a local stack's clients dial: loopback, this machine's names, and ``host`` unless a wildcard."""
    names = [*LOOPBACK, socket.gethostname(), socket.getfqdn()]
    if host and host not in ("0.0.0.0", "::"):
        names.append(host)
    return list(dict.fromkeys(n for n in names if n))


def generate(out_dir: str | Path, hosts: list[str], days: int = 825, ca_key_dir: str | Path | None = None
             ) -> dict[str, Path]:
    """Write FILES into ``out_dir`` (made 0700): a CA valid 10 years, and the services' and clients'
    certificates valid ``days`` (825: what browsers and most TLS stacks still accept). ``ca_key_dir``: the CA's
    key goes there instead (a place no service mounts: whoever holds it can mint any service's identity).
    Returns name -> path."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise AuthError("no host names for the services' certificate. Fix: --hosts with every name or address "
                        "clients and peers dial, e.g. --hosts coordinator.lab,10.0.0.5")
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def alt_name(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    def certificate(name: str, key, issuer: x509.Name, issuer_key, lifetime: datetime.timedelta, ca: bool,
                    usages: list | None = None, sans: list[str] | None = None) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer if not ca else subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + lifetime)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca, crl_sign=ca,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=not ca,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
        if not ca:
            builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer_key.public_key()), critical=False)
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName([alt_name(h) for h in sans]),
                                            critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("rlfabric deployment CA", ca_key, None, ca_key, datetime.timedelta(days=3650), ca=True)
    leaves = {
        "server": ("rlfabric service", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], hosts),
        "client": ("rlfabric client", [ExtendedKeyUsageOID.CLIENT_AUTH], None),
    }
    key_dir = Path(ca_key_dir) if ca_key_dir else out
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {"ca.pem": out / "ca.pem", "ca.key": write_private_file(key_dir / "ca.key", pem_key(ca_key))}
    paths["ca.pem"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name, (common_name, usages, sans) in leaves.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(common_name, key, ca.subject, ca_key, datetime.timedelta(days=days), ca=False,
                           usages=usages, sans=sans)
        paths[f"{name}.key"] = write_private_file(out / f"{name}.key", pem_key(key))
        paths[f"{name}.pem"] = out / f"{name}.pem"
        paths[f"{name}.pem"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return paths


def existing(out_dir: str | Path, ca_key_dir: str | Path | None = None) -> dict[str, Path] | None:
    """The files of an earlier ``generate`` in ``out_dir`` (the CA's key in ``ca_key_dir`` if given), or None
    unless every one is there."""
    paths = {name: Path(ca_key_dir if name == "ca.key" and ca_key_dir else out_dir) / name for name in FILES}
    return paths if all(p.is_file() for p in paths.values()) else None


def service_files(paths: dict[str, Path]) -> TLSFiles:
    """What a service serves and calls its peers with (mTLS)."""
    return TLSFiles(str(paths["server.pem"]), str(paths["server.key"]), str(paths["ca.pem"]))


def client_files(paths: dict[str, Path]) -> TLSFiles:
    """What a client (the CLI, a notebook) presents to mTLS services."""
    return TLSFiles(str(paths["client.pem"]), str(paths["client.key"]), str(paths["ca.pem"]))
