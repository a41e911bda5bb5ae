"""A container engine for scripts/compose_check.py: the one already running, or podman installed and started.

`find_engine` looks for an engine that answers the Docker API (DOCKER_HOST, Docker's socket, podman's
socket) and uses it as it is. Only when none answers, and only as root, `start_podman` installs
Debian's podman, writes the engine settings a machine without systemd and without CAP_SYS_RESOURCE
needs (only when /etc/containers/containers.conf does not exist yet), and starts podman's Docker API
service, which the caller stops again. Every system change is announced on stdout first.

`base_image` makes sure the Dockerfile's base image exists: present already, pulled from its registry,
or, when no registry can be reached, a local stand-in built from Debian's packages (debootstrap).
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from serving_common.uds import UnixHTTPConnection

PODMAN_SOCKET = pathlib.Path("/run/podman/podman.sock")
DOCKER_SOCKET = pathlib.Path("/var/run/docker.sock")
PODMAN_PACKAGES = ["podman", "runc", "catatonit", "netavark", "aardvark-dns", "iptables"]
CONTAINERS_CONF = pathlib.Path("/etc/containers/containers.conf")


def say(text: str) -> None:
    print(f"compose-check: {text}", flush=True)


def engine_name(docker_host: str, timeout: float = 3.0) -> str | None:
    """The engine's name ("Docker Engine", "Podman Engine") if one answers the Docker API at `docker_host`."""
    if docker_host.startswith("unix://"):
        connection: http.client.HTTPConnection = UnixHTTPConnection(docker_host.removeprefix("unix://"), timeout)
    elif docker_host.startswith("tcp://"):
        connection = http.client.HTTPConnection(docker_host.removeprefix("tcp://"), timeout=timeout)
    else:
        return None
    try:
        connection.request("GET", "/version")
        reply = connection.getresponse()
        body = json.loads(reply.read() or b"{}") if reply.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        connection.close()
    if not isinstance(body, dict):
        return None
    names = [c.get("Name", "") for c in body.get("Components") or [] if isinstance(c, dict)]
    return next((n for n in names if "Engine" in n), None) or "Docker Engine"


@dataclass
class Engine:
    """An engine that answers the Docker API; `cli` is its own command line tool (for build and import)."""

    docker_host: str
    kind: str  # "docker" | "podman"
    service: subprocess.Popen[bytes] | None = None  # the API service this script started, if it did
    runner: HealthRunner | None = None

    @property
    def cli(self) -> list[str]:
        return ["podman"] if self.kind == "podman" else ["docker", "--host", self.docker_host]

    def build_flags(self) -> list[str]:
        # podman builds in host networking (the sandbox has no bridge NAT for builds) and with Docker's image
        # format, which keeps the Dockerfile's HEALTHCHECK; never pull: the base is made sure of first.
        return ["--pull=never", "--network", "host", "--format", "docker"] if self.kind == "podman" else []

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()
        if self.service is not None and self.service.poll() is None:
            say(f"stopping the podman API service this check started (pid {self.service.pid})")
            self.service.terminate()
            try:
                self.service.wait(30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()


def find_engine() -> Engine | None:
    """The engine that already runs, used as it is: DOCKER_HOST first, then Docker's socket, then podman's."""
    candidates = [os.environ["DOCKER_HOST"]] if os.environ.get("DOCKER_HOST") else []
    candidates += [f"unix://{DOCKER_SOCKET}", f"unix://{PODMAN_SOCKET}"]
    for host in candidates:
        name = engine_name(host)
        if name is not None:
            return Engine(host, "podman" if "podman" in name.lower() else "docker")
    return None


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, **kwargs)  # type: ignore[call-overload]


def apt_install(packages: list[str], why: str) -> None:
    missing = [p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    say(f"installing Debian packages {' '.join(missing)} ({why}): this changes the system")
    run(["apt-get", "update", "-qq"])
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)


def podman_settings() -> str:
    """containers.conf for a machine like CI's: no systemd (cgroupfs, file events), crun refusing the hybrid
    cgroup layout (runc), and no CAP_SYS_RESOURCE to raise limits (the caller's own hard limits)."""
    nofile = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip() or "1024"
    return ("# Written by grok-serve's scripts/compose_check.py (podman on a machine without systemd).\n"
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
            "[engine]\n"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            'runtime = "runc"\n')


def planned_changes(podman: str | None = None, conf: pathlib.Path | None = None) -> list[str]:
    """What `start_podman` will change on this machine, in order, to be said before any of it is done."""
    podman = podman if podman is not None else (shutil.which("podman") or "")
    conf = conf or CONTAINERS_CONF
    changes = []
    if not podman:
        changes.append(f"install Debian packages ({' '.join(PODMAN_PACKAGES)}) with apt-get")
        if not conf.exists():
            changes.append(f"write {conf} (podman's settings for a machine without systemd; an existing file is "
                           "never changed)")
    changes.append(f"start podman's Docker API service on {PODMAN_SOCKET} (stopped when the check ends)")
    return changes


def start_podman(log_dir: pathlib.Path) -> Engine:
    """Install podman when missing (root only), configure it when unconfigured, start its Docker API service."""
    if os.geteuid() != 0:
        sys.exit("compose-check: no container engine answers (DOCKER_HOST, /var/run/docker.sock, "
                 f"{PODMAN_SOCKET}); start Docker or podman's API service, or run as root to let this "
                 "check install podman")
    say("no container engine answers here, so this check will change this machine:\n"
        + "".join(f"  - {change}\n" for change in planned_changes()).rstrip("\n"))
    if not shutil.which("podman"):
        apt_install(PODMAN_PACKAGES, "a container engine: none runs here")
        if not CONTAINERS_CONF.exists():
            say(f"writing {CONTAINERS_CONF} (runc, cgroupfs, file events, ulimits this machine allows)")
            CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
            CONTAINERS_CONF.write_text(podman_settings())
    PODMAN_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "podman-service.log", "wb")
    say(f"starting podman's Docker API service on {PODMAN_SOCKET} (stopped when the check ends)")
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{PODMAN_SOCKET}"],
                               stdout=log, stderr=subprocess.STDOUT)
    host = f"unix://{PODMAN_SOCKET}"
    done = threading.Event()
    while not done.wait(0.2):
        if service.poll() is not None:
            sys.exit(f"compose-check: podman's API service exited with {service.returncode}: "
                     f"see {log_dir / 'podman-service.log'}")
        if engine_name(host, timeout=1.0):
            break
    return Engine(host, "podman", service=service)


class HealthRunner:
    """Runs the containers' health checks every few seconds: podman schedules them with systemd timers, and
    without systemd they never run (compose's service_healthy would wait forever)."""

    def __init__(self, project: str, every: float = 5.0) -> None:
        self.project, self.every = project, every
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every):
            listed = subprocess.run(["podman", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
                                    capture_output=True, text=True)
            for container in listed.stdout.split():
                subprocess.run(["podman", "healthcheck", "run", container], capture_output=True)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)


def needs_health_runner(engine: Engine) -> bool:
    return engine.kind == "podman" and not pathlib.Path("/run/systemd/system").exists()


@dataclass
class BaseImage:
    """The Dockerfile's base image and where it came from."""

    name: str
    origin: str = ""
    notes: list[str] = field(default_factory=list)


def base_image_name(dockerfile: pathlib.Path) -> str:
    (name,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile.read_text(), re.M)
    return name


def image_exists(engine: Engine, name: str) -> bool:
    return subprocess.run([*engine.cli, "image", "inspect", name], capture_output=True).returncode == 0


def base_image(engine: Engine, dockerfile: pathlib.Path, work: pathlib.Path) -> BaseImage:
    """Make sure the base image exists: present, pulled, or (no registry reachable) a local stand-in."""
    base = BaseImage(base_image_name(dockerfile))
    if image_exists(engine, base.name):
        base.origin = "already present"
        return base
    say(f"pulling {base.name}")
    try:
        pulled = subprocess.run([*engine.cli, "pull", base.name], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pulled = None
    if pulled is not None and pulled.returncode == 0:
        base.origin = "pulled from its registry"
        return base
    reason = (pulled.stderr.strip().splitlines() or ["no answer"])[-1] if pulled is not None else "timed out"
    say(f"the registry cannot be reached ({reason[:200]}): making a local stand-in for {base.name} "
        "from Debian's packages")
    stand_in(engine, base.name, work)
    base.origin = "local stand-in (Debian bookworm + python3.11), no registry reachable"
    return base


def debian_mirror() -> str:
    """The Debian mirror apt already uses here (the build fetches packages the same way)."""
    for path in [*pathlib.Path("/etc/apt/sources.list.d").glob("*.sources"), pathlib.Path("/etc/apt/sources.list")]:
        if path.exists():
            found = re.search(r"(?:URIs:|^deb)\s+(?:\[[^]]*\]\s+)?(https?://\S*debian\S*?)/?(?:\s|$)",
                              path.read_text(), re.M)
            if found and "security" not in found.group(1):
                return found.group(1)
    return "http://deb.debian.org/debian"


STAND_IN = """\
FROM {root}
COPY certificates/ /usr/local/share/ca-certificates/
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev ca-certificates \\
 && update-ca-certificates \\
 && ln -s /usr/bin/python3.11 /usr/local/bin/python \\
 && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
"""


def stand_in(engine: Engine, name: str, work: pathlib.Path) -> None:
    """debootstrap a minimal bookworm, import it, and build python:3.11-slim-bookworm's stand-in on it: Debian's
    python3.11 and this machine's extra CA certificates (package downloads go through the same TLS path)."""
    apt_install(["debootstrap"], "to make a base image locally: no container registry is reachable")
    root_name = "localhost/grok-serve-check-debian:bookworm"
    if not image_exists(engine, root_name):
        tree = work / "bookworm"
        shutil.rmtree(tree, ignore_errors=True)
        say(f"debootstrap bookworm from {debian_mirror()} (a minute or two)")
        run(["debootstrap", "--variant=minbase", "bookworm", str(tree), debian_mirror()], stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", str(tree), "-c", "."], stdout=subprocess.PIPE)
        run([*engine.cli, "import", "-", root_name], stdin=tar.stdout, stdout=subprocess.DEVNULL)
        tar.wait()
        shutil.rmtree(tree, ignore_errors=True)
    context = work / "stand-in"
    shutil.rmtree(context, ignore_errors=True)
    (context / "certificates").mkdir(parents=True)
    for crt in pathlib.Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copy(crt, context / "certificates" / crt.name)
    (context / "Dockerfile").write_text(STAND_IN.format(root=root_name))
    # Under the name the Dockerfile's FROM resolves to (a short name means Docker Hub's library).
    full = name if "/" in name.split(":")[0] else f"docker.io/library/{name}"
    run([*engine.cli, "build", *engine.build_flags(), "-t", full, str(context)], stdout=subprocess.DEVNULL)
