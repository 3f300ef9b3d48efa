"""Collect the wheels of scaletrain's dependencies that a target environment lacks, for offline compute nodes.

On a machine with internet, for the nodes' Python and platform (`make wheelhouse PYTHON_VERSION=3.12`):

    .venv/bin/python launch/wheelhouse.py --python-version 3.12 --have node-packages.txt

where node-packages.txt is `python -m pip list --format=freeze` run on a node (in its image). Then on the
nodes, from the scaletrain checkout:

    python -m pip install --no-index --find-links wheelhouse -r wheelhouse/requirements.txt -e .

Each package is downloaded alone (`pip download --no-deps --only-binary=:all:` for the target's Python and
manylinux platforms) and the dependency tree is walked here, from each wheel's METADATA Requires-Dist with
the target's environment markers, because a package the nodes already have at a satisfying version must not
be downloaded, nor its dependencies followed: `pip download -r` cannot be told what the target has. torch,
triton and NVIDIA's CUDA libraries are never collected unless --include-torch: GPU images ship their own CUDA
build of torch. Everything is written into a temporary directory beside the wheelhouse and renamed into
place at the end, so a failed run leaves no half-written wheelhouse.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors tomli
    from pip._vendor import tomli as tomllib

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ModuleNotFoundError:  # pip vendors packaging, so this runs wherever pip does
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import InvalidVersion, Version

REPOSITORY = Path(__file__).resolve().parents[1]
MANIFEST = "requirements.txt"
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"

# The oldest glibc a PEP 600 tag names per architecture (as packaging's own tag list for a Linux host:
# x86_64 wheels go back to manylinux1's glibc 2.5, aarch64 ones start at manylinux2014's 2.17), and the
# legacy names pip compares literally (PEP 600: manylinux1 = 2.5, manylinux2010 = 2.12, manylinux2014 = 2.17).
OLDEST_GLIBC_MINOR = {"x86_64": 5, "aarch64": 17}
LEGACY_MANYLINUX = {"x86_64": {5: "manylinux1", 12: "manylinux2010", 17: "manylinux2014"},
                    "aarch64": {17: "manylinux2014"}}

# torch's own stack: GPU images ship a CUDA build of torch with these, and PyPI's would replace it.
TORCH_STACK = {"torch", "triton", "pytorch-triton"}
TORCH_STACK_PREFIX = "nvidia-"


@dataclass(frozen=True)
class SourceBuild:
    """How to build a package PyPI has only as an sdist into a pure-Python wheel that suits any target."""

    environment: dict[str, str]
    needs: str


# DeepSpeed publishes only an sdist. DS_BUILD_OPS=0 compiles none of its CUDA/C++ ops ahead of time (they
# are JIT-built on first use), so the wheel is pure Python; its setup.py imports torch, hence
# --no-build-isolation with this Python's torch.
SOURCE_BUILDS = {"deepspeed": SourceBuild({"DS_BUILD_OPS": "0"},
                                          "torch importable in the Python that runs this script (.venv/bin/python)")}


class WheelhouseError(Exception):
    """A bad input or a failed download: the message names the culprit and the fix."""


@dataclass(frozen=True)
class Target:
    """The nodes' CPython version and manylinux platform (the newest glibc they run, and the machine)."""

    python_version: str
    glibc_minor: int
    arch: str

    @property
    def platform(self) -> str:
        return f"manylinux_2_{self.glibc_minor}_{self.arch}"

    def pip_platforms(self) -> list[str]:
        """Every manylinux tag the nodes accept: pip matches --platform exactly, never an older glibc's tag."""
        minors = range(self.glibc_minor, OLDEST_GLIBC_MINOR[self.arch] - 1, -1)
        tags = [f"manylinux_2_{minor}_{self.arch}" for minor in minors]
        legacy = LEGACY_MANYLINUX[self.arch]
        return tags + [f"{legacy[minor]}_{self.arch}" for minor in sorted(legacy, reverse=True) if minor in minors]

    def pip_arguments(self) -> list[str]:
        platforms = [f"--platform={platform}" for platform in self.pip_platforms()]
        return ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python_version, *platforms]

    def marker_environment(self) -> dict[str, str]:
        """PEP 508's environment markers as they evaluate on the nodes."""
        major_minor = ".".join(self.python_version.split(".")[:2])
        full = self.python_version if self.python_version.count(".") == 2 else f"{self.python_version}.0"
        return {"python_version": major_minor, "python_full_version": full, "implementation_name": "cpython",
                "implementation_version": full, "platform_python_implementation": "CPython", "os_name": "posix",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.arch,
                "platform_release": "", "platform_version": "", "extra": ""}


def parse_target(python_version: str, platform: str) -> Target:
    if not re.fullmatch(r"3\.\d{1,2}(\.\d{1,2})?", python_version):
        raise WheelhouseError(f"--python-version {python_version!r} is not a CPython version like 3.12; give the "
                              "nodes' `python3 --version` as MAJOR.MINOR (e.g. PYTHON_VERSION=3.12)")
    legacy = re.fullmatch(r"manylinux2014_(x86_64|aarch64)", platform)
    match = legacy or re.fullmatch(r"manylinux_2_(\d{1,2})_(x86_64|aarch64)", platform)
    if match is None:
        raise WheelhouseError(f"--platform {platform!r} is not a manylinux platform like {DEFAULT_PLATFORM} "
                              "(glibc 2.28 on x86_64); give the nodes' glibc (`ldd --version`) and machine "
                              "(`uname -m`, x86_64 or aarch64)")
    glibc_minor, arch = (17, match[1]) if legacy else (int(match[1]), match[2])
    if glibc_minor < OLDEST_GLIBC_MINOR[arch]:
        raise WheelhouseError(f"--platform {platform!r}: no manylinux wheel targets glibc 2.{glibc_minor} on {arch}; "
                              f"the oldest is manylinux_2_{OLDEST_GLIBC_MINOR[arch]}_{arch}")
    return Target(python_version, glibc_minor, arch)


def read_have(path: Path) -> dict[str, Version]:
    """The packages of `pip list --format=freeze` (or a `pip freeze` with only NAME==VERSION lines)."""
    fix = f"write it on a node with `python -m pip list --format=freeze > {path.name}`"
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise WheelhouseError(f"--have {path}: cannot read it ({error}); {fix}") from None
    have = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        try:
            version = Version(match[2]) if match else None
        except InvalidVersion:
            version = None
        if version is None:
            raise WheelhouseError(f"--have {path}, line {number}: {line!r} is not NAME==VERSION as pip freeze "
                                  f"writes it; {fix} (plain `pip freeze` writes `NAME @ URL` for some packages)")
        have[canonicalize_name(match[1])] = version
    if not have:
        raise WheelhouseError(f"--have {path} lists no packages; {fix}")
    return have


@dataclass(frozen=True)
class Project:
    """What pyproject.toml says the project needs: to run, on which Pythons, and to be built."""

    name: str
    dependencies: tuple[str, ...]
    requires_python: SpecifierSet
    build_requires: tuple[str, ...]


def read_project(directory: Path) -> Project:
    pyproject = tomllib.loads((directory / "pyproject.toml").read_text())
    project = pyproject["project"]
    return Project(project["name"], tuple(project.get("dependencies", ())),
                   SpecifierSet(project.get("requires-python", "")),
                   tuple(pyproject.get("build-system", {}).get("requires", ())))


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: Version
    requires: tuple[str, ...]


def read_wheel(path: Path) -> Wheel:
    """A wheel's name, version and Requires-Dist, from its .dist-info/METADATA (an email-header file)."""
    with zipfile.ZipFile(path) as archive:
        members = [name for name in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", name)]
        if len(members) != 1:
            raise WheelhouseError(f"{path.name} has no single .dist-info/METADATA; it is not a wheel")
        metadata = email.parser.BytesParser().parsebytes(archive.read(members[0]), headersonly=True)
    return Wheel(path, canonicalize_name(metadata["Name"]), Version(metadata["Version"]),
                 tuple(metadata.get_all("Requires-Dist") or ()))


def active_requirements(requires: Iterable[str], environment: dict[str, str], groups: Iterable[str],
                        source: str) -> list[Requirement]:
    """The requirements (Requires-Dist lines) that apply on the target, for the groups asked: "" is the package
    itself, any other name one of its extras (whose lines are those whose marker holds only with that extra)."""
    active = []
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement as error:
            raise WheelhouseError(f"{source}: requirement {line!r} does not parse ({error})") from None
        marker = requirement.marker
        itself = marker is None or marker.evaluate({**environment, "extra": ""})
        if any(itself if group == "" else not itself and marker.evaluate({**environment, "extra": group})
               for group in groups):
            active.append(requirement)
    return active


def is_torch_stack(name: str) -> bool:
    return name in TORCH_STACK or name.startswith(TORCH_STACK_PREFIX)


def pip(arguments: list[str], into: Path, environment: dict[str, str] | None = None) -> Path:
    """Runs pip to put exactly one wheel into the empty directory `into`; returns it, or raises pip's error."""
    command = [sys.executable, "-m", "pip", *arguments, "--no-deps", "--disable-pip-version-check", "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(environment or {})})
    if result.returncode != 0:
        errors = [line.removeprefix("ERROR: ") for line in result.stderr.splitlines() if line.startswith("ERROR:")]
        raise WheelhouseError((errors or [" ".join(result.stderr.strip().splitlines()[-3:])])[0])
    (wheel,) = into.glob("*.whl")
    return wheel


def download_wheel(requirement: str, target: Target, into: Path) -> Path:
    return pip(["download", *target.pip_arguments(), "--dest", str(into), requirement], into)


def build_pure_wheel(requirement: str, build: SourceBuild, into: Path) -> Path:
    """`pip wheel` of an sdist with this Python; the wheel must come out pure Python to suit the target."""
    try:
        wheel = pip(["wheel", "--no-build-isolation", "--wheel-dir", str(into), requirement], into, build.environment)
    except WheelhouseError as error:
        raise WheelhouseError(f"building {requirement} from its sdist failed: {error} (the build needs "
                              f"{build.needs})") from None
    if not wheel.name.endswith("-none-any.whl"):
        raise WheelhouseError(f"building {requirement} gave {wheel.name}, not a pure-Python wheel (*-none-any.whl) "
                              f"that suits any target; check {' '.join(map('='.join, build.environment.items()))}")
    return wheel


class Collector:
    """Walks the dependency tree from the project's requirements, downloading what the target lacks.

    Requirements on one name from several parents are intersected; a wheel that a later, stricter parent
    rules out is replaced (what the replaced version required stays queued: the walk never un-collects). A
    package the target has at a satisfying version is not downloaded and its own dependencies are not
    followed (the target has them), except those of extras asked for it (fsspec[http]).
    """

    def __init__(self, target: Target, have: dict[str, Version], wheels_dir: Path, scratch: Path,
                 include_torch: bool = False, excluded: Iterable[str] = (), log: Callable[[str], None] = print):
        self.target, self.have, self.wheels_dir, self.scratch = target, have, wheels_dir, scratch
        self.include_torch, self.excluded, self.log = include_torch, {canonicalize_name(n) for n in excluded}, log
        self.environment = target.marker_environment()
        self.specifiers: dict[str, SpecifierSet] = {}
        self.extras: dict[str, set[str]] = {}
        self.wanted_by: dict[str, list[str]] = {}
        self.wheels: dict[str, Wheel] = {}  # collected into the wheelhouse
        self.on_target: dict[str, Version] = {}  # in --have at a satisfying version
        self.left_out: dict[str, str] = {}  # name -> why
        self.followed: dict[str, tuple[Version, set[str]]] = {}  # version, groups whose requirements were queued
        self.pending: deque[str] = deque()

    def require_all(self, requires: Iterable[str], groups: Iterable[str], wanted_by: str) -> None:
        for requirement in active_requirements(requires, self.environment, groups, wanted_by):
            name = canonicalize_name(requirement.name)
            self.specifiers[name] = self.specifiers.get(name, SpecifierSet()) & requirement.specifier
            self.extras.setdefault(name, set()).update(canonicalize_name(extra) for extra in requirement.extras)
            parents = self.wanted_by.setdefault(name, [])
            if wanted_by not in parents:
                parents.append(wanted_by)
            self.pending.append(name)

    def collect(self) -> None:
        while self.pending:
            self.visit(self.pending.popleft())

    def visit(self, name: str) -> None:
        specifier, present = self.specifiers[name], self.have.get(name)
        if present is not None and specifier.contains(present, prereleases=True):
            self.on_target[name] = present
            self.follow(name, present, self.extras[name])
            return
        self.on_target.pop(name, None)
        reason = self.reason_to_leave_out(name, present)
        if reason is not None:
            self.left_out[name] = reason
            return
        wheel = self.wheels.get(name)
        if wheel is None or not specifier.contains(wheel.version, prereleases=True):
            if wheel is not None:
                wheel.path.unlink()
            wheel = self.wheels[name] = self.keep(self.fetch(name, f"{name}{specifier}"))
            self.log(f"{wheel.path.name}  (wanted by {self.describe_parents(name)})")
        self.follow(name, wheel.version, {""} | self.extras[name], wheel)

    def reason_to_leave_out(self, name: str, present: Version | None) -> str | None:
        if name in self.excluded:
            return "--exclude"
        if not is_torch_stack(name) or self.include_torch:
            return None
        if present is not None:
            raise WheelhouseError(
                f"{name} {present} on the target does not satisfy {name}{self.specifiers[name]} (wanted by "
                f"{self.describe_parents(name)}); use an image with a newer {name}, or pass --include-torch to "
                "collect PyPI's (a CUDA build with its nvidia-* libraries, several GB)")
        return "the target's own (CUDA) build is expected; --include-torch collects PyPI's"

    def follow(self, name: str, version: Version, groups: set[str], wheel: Wheel | None = None) -> None:
        """Queues the requirements of `groups` ("" = the package itself, else extras) not queued before."""
        followed_version, done = self.followed.get(name, (None, set()))
        done = done if followed_version == version else set()
        new = groups - done
        if not new:
            return
        if wheel is None:  # on the target: its extras' requirements are read from the same version's wheel
            wheel = self.fetch(name, f"{name}=={version.public}")
        self.require_all(wheel.requires, new, f"{name} {version}")
        self.followed[name] = (version, done | new)

    def fetch(self, name: str, requirement: str) -> Wheel:
        """The wheel of `requirement`, in a directory of its own under the scratch directory."""
        incoming = Path(tempfile.mkdtemp(dir=self.scratch))
        if name in SOURCE_BUILDS:
            return read_wheel(build_pure_wheel(requirement, SOURCE_BUILDS[name], incoming))
        try:
            return read_wheel(download_wheel(requirement, self.target, incoming))
        except WheelhouseError as error:
            raise WheelhouseError(
                f"pip found no wheel of {requirement} (wanted by {self.describe_parents(name)}) for CPython "
                f"{self.target.python_version} on {self.target.platform} ({error}). Fix: if the nodes have it, "
                f"list it in --have; if PyPI has it only for a newer glibc, give the nodes' own platform "
                f"(e.g. --platform manylinux_2_35_{self.target.arch}); or leave it out with --exclude {name}"
            ) from None

    def collect_build_requirements(self, requires: Iterable[str], project_name: str) -> list[Wheel]:
        """The project's [build-system] requires, whatever --have says: pip's isolated build of `-e .` installs
        them from the wheelhouse only, never from the target's site-packages."""
        wheels = []
        for line in requires:
            name = canonicalize_name(Requirement(line).name)
            self.wanted_by.setdefault(name, []).append(f"{project_name}'s build")
            wheels.append(self.keep(self.fetch(name, line)))
            self.log(f"{wheels[-1].path.name}  (builds {project_name})")
        return wheels

    def keep(self, wheel: Wheel) -> Wheel:
        path = self.wheels_dir / wheel.path.name
        shutil.move(wheel.path, path)
        return Wheel(path, wheel.name, wheel.version, wheel.requires)

    def describe_parents(self, name: str) -> str:
        parents = self.wanted_by.get(name, [])
        return ", ".join(parents[:3]) + (f" and {len(parents) - 3} more" if len(parents) > 3 else "")


def check_destination(destination: Path) -> None:
    """Refuses to replace a directory that is not a wheelhouse (WHEELHOUSE=. must not delete a checkout)."""
    if not destination.exists():
        return
    strangers = [] if not destination.is_dir() else [
        path.name for path in destination.iterdir() if path.suffix != ".whl" and path.name != MANIFEST]
    if not destination.is_dir() or strangers:
        found = f"holds {strangers[0]}" if strangers else "is a file"
        raise WheelhouseError(f"--wheelhouse {destination} {found}, so it is not a wheelhouse this script wrote; "
                              "give a new or empty directory, or the wheelhouse of an earlier run to replace it")


def publish(staging: Path, destination: Path) -> None:
    """Renames the finished wheelhouse into place; an earlier one there is removed only after."""
    if not destination.exists():
        staging.rename(destination)
        return
    earlier = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.earlier-"))
    destination.rename(earlier / destination.name)
    staging.rename(destination)
    shutil.rmtree(earlier)


def install_command(destination: Path) -> str:
    return f"python -m pip install --no-index --find-links {destination} -r {destination / MANIFEST} -e ."


def write_manifest(staging: Path, collector: Collector, build_wheels: list[Wheel], destination: Path,
                   have_path: Path | None, project: Project) -> None:
    """requirements.txt: NAME==VERSION of each runtime wheel, so pip installs exactly these."""
    target, lacks = collector.target, f"--have {have_path.name}" if have_path else "no --have list"
    lines = [f"# {project.name}'s dependencies for CPython {target.python_version} on {target.platform} that the "
             f"target ({lacks}) lacks,", "# written by launch/wheelhouse.py. On the nodes, from the checkout:",
             f"#   {install_command(destination)}"]
    lines += [f"# {wheel.path.name} is {project.name}'s build backend (pip's isolated build of -e .), "
              "not installed." for wheel in build_wheels]
    lines += [f"{name}=={collector.wheels[name].version}" for name in sorted(collector.wheels)]
    (staging / MANIFEST).write_text("\n".join(lines) + "\n")


def build_wheelhouse(project_dir: Path, target: Target, have: dict[str, Version], destination: Path,
                     have_path: Path | None = None, include_torch: bool = False, excluded: Iterable[str] = (),
                     log: Callable[[str], None] = print) -> Collector:
    """Collects into a temporary directory beside `destination`, then renames it there."""
    project = read_project(project_dir)
    if not project.requires_python.contains(target.python_version, prereleases=True):
        raise WheelhouseError(f"--python-version {target.python_version}: {project.name} requires Python "
                              f"{project.requires_python} (pyproject.toml's requires-python); give one it supports")
    check_destination(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.partial-"))
    try:
        with tempfile.TemporaryDirectory() as scratch:
            collector = Collector(target, have, staging, Path(scratch), include_torch, excluded, log)
            collector.require_all(project.dependencies, {""}, project.name)
            collector.collect()
            build_wheels = collector.collect_build_requirements(project.build_requires, project.name)
            write_manifest(staging, collector, build_wheels, destination, have_path, project)
        publish(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return collector


def report(collector: Collector, destination: Path) -> None:
    wheels = sorted(destination.glob("*.whl"))
    megabytes = sum(path.stat().st_size for path in wheels) / 2**20
    print(f"wheelhouse: {len(wheels)} wheels, {megabytes:.1f} MiB, in {destination} for CPython "
          f"{collector.target.python_version} on {collector.target.platform}")
    if collector.on_target:
        print(f"  on the target already: {', '.join(sorted(collector.on_target))}")
    for name in sorted(set(collector.wheels) & set(collector.have)):
        print(f"  upgraded on the target: {name} {collector.have[name]} -> {collector.wheels[name].version} "
              f"({name}{collector.specifiers[name]}, wanted by {collector.describe_parents(name)})")
    for name, reason in sorted(collector.left_out.items()):
        print(f"  not collected: {name}{collector.specifiers[name]} ({reason})")
    print(f"install on the nodes, from the checkout:\n  {install_command(destination)}")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", required=True, help="the nodes' CPython, MAJOR.MINOR (3.12)")
    parser.add_argument("--platform", default=DEFAULT_PLATFORM,
                        help=f"the nodes' manylinux_2_<glibc minor>_<machine> (default {DEFAULT_PLATFORM})")
    parser.add_argument("--have", type=Path, help="`python -m pip list --format=freeze` from a node: what to skip")
    parser.add_argument("--wheelhouse", type=Path, default=Path("wheelhouse"), help="output directory")
    parser.add_argument("--include-torch", action="store_true", help="collect torch, triton and nvidia-* too")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME", help="a package not to collect")
    parser.add_argument("--project", type=Path, default=REPOSITORY, help="the directory of pyproject.toml")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    try:
        target = parse_target(arguments.python_version, arguments.platform)
        have = read_have(arguments.have) if arguments.have else {}
        collector = build_wheelhouse(arguments.project, target, have, arguments.wheelhouse, arguments.have,
                                     arguments.include_torch, arguments.exclude,
                                     log=lambda line: print(f"wheelhouse: {line}", flush=True))
    except WheelhouseError as error:
        print(f"wheelhouse: error: {error}", file=sys.stderr)
        return 2
    report(collector, arguments.wheelhouse)
    return 0


if __name__ == "__main__":
    sys.exit(main())
