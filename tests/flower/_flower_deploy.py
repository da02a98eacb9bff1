"""Real Flower processes on 127.0.0.1 for the deployment tests.

Every process starts in its own session (process group); teardown collects the whole process
tree first (the SuperLink's SuperExec runs in a session of its own), terminates it, kills what is
left, and finally kills any process whose command line mentions the test's folder (e.g. a
local SuperLink that ``flwr run`` started under ``FLWR_HOME``). Certificates and SuperNode keys
are generated per test with ``cryptography`` (a Flower dependency).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def flower_binaries_missing() -> str | None:
    for name in ("flower-superlink", "flower-supernode", "flwr"):
        if not (BIN / name).exists() and shutil.which(name) is None:
            return f"{name} is not installed (pip install 'fedmosaic[flower]')"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exe(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else name


# ---- process tree -------------------------------------------------------------------------------
def _stats() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(entry)] = (int(fields[1]), int(fields[2]))
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants(pids: list[int]) -> set[int]:
    """``pids``, their descendants, and the members of their process groups (orphans whose
    parent already exited keep the group of the session we started)."""
    stats = _stats()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    groups = set(pids)
    seen: set[int] = set()
    todo = list(pids) + [pid for pid, (_, pgid) in stats.items() if pgid in groups]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, []))
    return seen


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is not running


def mentioning(text: str) -> set[int]:
    """Running processes whose command line contains ``text``."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd and alive(int(entry)):
                out.add(int(entry))
    return out


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_tree(roots: list[int], wait: float = 10.0) -> set[int]:
    """SIGTERM the trees under ``roots`` (and their process groups), then SIGKILL leftovers.

    Returns the pids it targeted (collected before anything was signalled)."""
    pids = {p for p in descendants(roots) if alive(p)}
    for root in roots:
        try:
            os.killpg(root, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    _signal({p for p in pids if alive(p)}, signal.SIGKILL)
    return pids


# ---- certificates and keys ------------------------------------------------------------------------
def make_tls(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fedmosaic test CA"))
        .issuer_name(name("fedmosaic test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    return paths


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in OpenSSH format (what SuperNode authentication uses)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return private, public


def _kernel_cache() -> dict[str, str]:
    """``XDG_CACHE_HOME`` naming the cache the runner's native kernels live in (empty without one)."""
    from fedmosaic import kernels

    root = kernels.cache_root()  # <base>/fedmosaic/kernels
    return {"XDG_CACHE_HOME": str(root.parents[1])} if root is not None else {}


# ---- the deployment ---------------------------------------------------------------------------
class Deployment:
    """A SuperLink and SuperNodes as real processes; ``close()`` leaves nothing running.

    ``long_running``: SuperNodes started with ``python -m fedmosaic.flower.node`` (one
    ClientApp process per SuperNode, capped polling) instead of ``flower-supernode``. Every
    process gets ``FLWR_HOME`` and ``HOME`` inside ``root``: what Flower writes to a user's home
    (``~/.flwr``) shows up under ``self.home``.
    """

    def __init__(
        self, root: Path, tls: dict[str, Path] | None = None, long_running: bool = True
    ) -> None:
        self.root = root
        self.tls = tls
        self.long_running = long_running
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.flwr_home = root / "flwr-home"
        self.home = root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(
            os.environ,
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            FLWR_HOME=str(self.flwr_home),
            HOME=str(self.home),
            # the native kernels from the runner's cache: with HOME moved, each SuperNode would
            # build them anew (about 25 s, three at once on 2 cores)
            **_kernel_cache(),
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            PYTHONUNBUFFERED="1",
        )

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        workdir = self.root / name
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{name}.log", "wb") as fh:
            proc = subprocess.Popen(
                args,
                cwd=workdir,
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def start_superlink(self, supernode_auth: bool = False, database: bool = True) -> None:
        """``database``: state in ``superlink.db`` (as in production); else Flower's in-memory
        state (no SQLite writes per request: the overhead benchmark's loopback default)."""
        args = [_exe("flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port)]
        if self.tls:
            args += [
                "--ssl-ca-certfile", str(self.tls["ca"]),
                "--ssl-certfile", str(self.tls["cert"]),
                "--ssl-keyfile", str(self.tls["key"]),
            ]  # fmt: skip
        else:
            args += ["--insecure"]
        if supernode_auth:
            args += ["--enable-supernode-auth"]
        args += ["--disable-runtime-dependency-installation"]
        if database:
            args += ["--database", str(self.root / "superlink.db")]
        self.start("superlink", args)
        self.wait_healthy("superlink", self.port, secure=bool(self.tls))

    def start_supernode(
        self, name: str, node_config: str, key: Path | None = None, extra: list[str] | None = None
    ) -> int:
        port = free_port()
        node = [sys.executable, "-m", "fedmosaic.flower.node"]
        args = node if self.long_running else [_exe("flower-supernode")]
        args += ["--superlink", self.address, "--port", str(port)]
        args += ["--root-certificates", str(self.tls["ca"])] if self.tls else ["--insecure"]
        if key is not None:
            args += ["--auth-supernode-private-key", str(key)]
        args += ["--node-config", node_config, *(extra or [])]
        self.start(name, args)
        return port

    def wait_healthy(self, name: str, port: int, secure: bool, timeout: float = 90.0) -> None:
        """Readiness probe: the process is alive and ``/health`` answers."""
        ctx = None
        if secure and self.tls:
            ctx = ssl.create_default_context(cafile=str(self.tls["ca"]))
        url = f"{'https' if secure else 'http'}://127.0.0.1:{port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{self.log(name)[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{name} not healthy after {timeout}s:\n{self.log(name)[-3000:]}")

    def write_connection(self) -> None:
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", 'default = "test"', "", "[superlink.test]"]
        lines.append(f'address = "{self.address}"')
        lines.append(f'root-certificates = "{self.tls["ca"]}"' if self.tls else "insecure = true")
        (self.flwr_home / "config.toml").write_text("\n".join(lines) + "\n")

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI against this deployment's SuperLink (connection ``test``)."""
        return subprocess.run(
            [_exe("flwr"), *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop one process and its tree (a SuperNode 'disappearing')."""
        proc = self.procs[name]
        pids = descendants([proc.pid])
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        _signal(pids, sig)
        proc.wait(timeout=30)

    def close(self) -> list[int]:
        """Terminate everything started here; returns pids still running afterwards."""
        targeted = terminate_tree([p.pid for p in self.procs.values()])
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        strays = mentioning(str(self.root))  # e.g. a local SuperLink under our FLWR_HOME
        if strays:
            targeted |= terminate_tree(sorted(strays), wait=5.0)
        time.sleep(0.2)
        return sorted({p for p in targeted if alive(p)} | mentioning(str(self.root)))
