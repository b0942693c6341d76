"""The run's TLS certificate for its generators' HTTPS (`cluster.generator_tls`; docs/design.md, "Trust model").

    RUN/tls/cert.pem   a self-signed server certificate (ECDSA P-256, no CA above it) naming every address and host
                       name the run's clients reach a generator by (subjectAltName: IP entries for addresses, DNS
                       entries for names); what every client of the run trusts, and nothing else
                       (`http_json.TLS_CA_ENV`, set by the launcher for itself and every role)
    RUN/tls/key.pem    its private key, mode 0600 from its creation (the folder 0700); read only by the generators
                       (`scalerl serve --ssl-keyfile`)

`run_tls(run_dir, hosts)` makes them on the run's first launch with TLS and returns the same files to every later one
(`--resume`, a requeued job), as `RUN/api_key` is made once. A launch whose hosts the certificate does not name (a job
requeued onto other nodes), or that finds it within `RENEW_BEFORE` of its end, makes a new key and certificate naming
the old hosts and the new, before any role starts. A key file other users may read is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import atomic_write_bytes

TLS_DIR = "tls"
CERT_FILE, KEY_FILE = "cert.pem", "key.pem"
VALID_FOR = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=7)  # a launch renews a certificate that ends sooner (a run lasts weeks)
CLOCK_SKEW = datetime.timedelta(hours=1)  # valid from an hour back: the nodes' clocks may differ a little


@dataclass(frozen=True)
class RunTLS:
    """The run's certificate (`cert`: what clients trust) and private key (`key`: the generators' alone)."""

    cert: Path
    key: Path

    @classmethod
    def of(cls, run_dir: str | Path) -> RunTLS:
        folder = Path(run_dir) / TLS_DIR
        return cls(folder / CERT_FILE, folder / KEY_FILE)


def run_tls(run_dir: str | Path, hosts: Iterable[str]) -> RunTLS:
    """The run's certificate and key (`RunTLS.of(run_dir)`) for generators reached at `hosts` (IP addresses and
    host names): the existing pair when it names every host and is not about to end, else a new pair naming those
    and the old certificate's names. UserError when the key file is readable by other users."""
    tls = RunTLS.of(run_dir)
    wanted = {str(h) for h in hosts if str(h)}
    named: set[str] = set()
    if tls.cert.is_file() and tls.key.is_file():
        _check_private(tls.key)
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
        named = certificate_hosts(cert)
        now = datetime.datetime.now(datetime.UTC)
        if wanted <= named and cert.not_valid_after_utc - now > RENEW_BEFORE:
            return tls
    _issue(tls, sorted(wanted | named))
    return tls


def certificate_hosts(cert: x509.Certificate | Path) -> set[str]:
    """The addresses and names a certificate (or a PEM file of one) is valid for, as strings."""
    if isinstance(cert, Path):
        cert = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} | set(names.get_values_for_type(x509.DNSName))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _issue(tls: RunTLS, hosts: list[str]) -> None:
    if not hosts:
        raise ValueError("a generator certificate needs at least one host")
    tls.key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "scalerl generators")])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALID_FOR)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
    atomic_write_bytes(tls.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()), mode=0o600)
    atomic_write_bytes(tls.cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o600)


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UserError(f"TLS key file {path}: other users may read it (mode {mode:03o}); chmod 600 {path}")
