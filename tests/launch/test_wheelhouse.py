"""launch/wheelhouse.py (issue 36): the target's platforms and markers, Requires-Dist from a wheel's METADATA,
the --have filter, the errors for bad input, and a walk through real pip against a local folder of wheels
(PIP_NO_INDEX). Nothing here reaches PyPI unless SCALETRAIN_WHEELHOUSE_PYPI=1."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from launch import wheelhouse
from launch.wheelhouse import Collector, WheelhouseError, active_requirements, parse_target, read_have, read_wheel

X86_312 = parse_target("3.12", "manylinux_2_28_x86_64")


def make_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel; the METADATA body repeats a header, which must not count."""
    dist = f"{name.replace('-', '_')}-{version}"
    headers = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
               *(f"Requires-Dist: {line}" for line in requires)]
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist}.dist-info/METADATA", "\n".join(headers) + "\n\nRequires-Dist: from-the-body\n")
        archive.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def make_project(directory: Path, dependencies: list[str]) -> Path:
    directory.mkdir()
    listed = ", ".join(f'"{line}"' for line in dependencies)
    (directory / "pyproject.toml").write_text(
        f'[project]\nname = "demo"\nrequires-python = ">=3.10"\ndependencies = [{listed}]\n')
    return directory


def test_platforms_are_every_manylinux_tag_up_to_the_nodes_glibc():
    tags = X86_312.pip_platforms()
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_29_x86_64" not in tags
    assert {"manylinux_2_17_x86_64", "manylinux_2_5_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    arm = parse_target("3.12.4", "manylinux2014_aarch64")
    assert arm.pip_platforms() == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    assert arm.marker_environment()["python_full_version"] == "3.12.4"
    assert arm.marker_environment()["python_version"] == "3.12"


@pytest.mark.parametrize(("python_version", "platform", "culprit"), [
    ("3,12", "manylinux_2_28_x86_64", "--python-version '3,12'"),
    ("312", "manylinux_2_28_x86_64", "--python-version '312'"),
    ("3.12", "linux_x86_64", "--platform 'linux_x86_64'"),
    ("3.12", "manylinux_2_28_arm64", "uname -m"),
    ("3.12", "manylinux_2_12_aarch64", "manylinux_2_17_aarch64"),
])
def test_a_bad_target_names_the_value_and_the_fix(python_version, platform, culprit):
    with pytest.raises(WheelhouseError, match=culprit):
        parse_target(python_version, platform)


def test_requires_dist_from_metadata_headers_with_the_targets_markers(tmp_path):
    requires = ("torch>=2.6", "tomli; python_version < '3.11'", "typing-extensions>=4; python_version >= '3.12'",
                "aiohttp; extra == 'http'", "pywin32; sys_platform == 'win32'",
                "requests; platform_machine == 'aarch64' and extra == 'http'")
    wheel = read_wheel(make_wheel(tmp_path, "Demo_Pkg", "1.0", requires))
    assert (wheel.name, wheel.version, wheel.requires) == ("demo-pkg", Version("1.0"), requires)

    def names(target, groups):
        return [requirement.name for requirement in active_requirements(wheel.requires, target.marker_environment(),
                                                                        groups, "demo")]

    assert names(X86_312, {""}) == ["torch", "typing-extensions"]
    assert names(X86_312, {"http"}) == ["aiohttp"]
    assert names(parse_target("3.10", "manylinux_2_28_aarch64"), {"", "http"}) == ["torch", "tomli", "aiohttp",
                                                                                  "requests"]


def test_have_reads_pip_list_freeze_with_normalized_names(tmp_path):
    have = tmp_path / "have.txt"
    have.write_text("# from a node\n\nPyYAML==6.0.2\ntyping_extensions==4.15.0\ntorch==2.11.0+cu128\n")
    assert read_have(have) == {"pyyaml": Version("6.0.2"), "typing-extensions": Version("4.15.0"),
                               "torch": Version("2.11.0+cu128")}


@pytest.mark.parametrize(("text", "culprit"), [
    ("torch==2.11.0\nnumpy @ file:///croot/numpy/work\n", "line 2: 'numpy @ file:///croot/numpy/work'"),
    ("-e git+https://github.com/NVIDIA/apex#egg=apex\n", "line 1"),
    ("numpy>=1.26\n", "line 1: 'numpy>=1.26'"),
    ("torch==not.a.version\n", "line 1"),
    ("# nothing\n", "lists no packages"),
])
def test_a_have_file_that_is_not_pip_freeze_names_the_line_and_the_fix(tmp_path, text, culprit):
    have = tmp_path / "have.txt"
    have.write_text(text)
    with pytest.raises(WheelhouseError, match=culprit) as raised:
        read_have(have)
    assert "pip list --format=freeze" in str(raised.value)


def walk(tmp_path, dependencies, have, **options) -> Collector:
    """A walk that the tests expect to need no download (everything is on the target or left out)."""
    collector = Collector(X86_312, have, tmp_path, tmp_path, log=lambda line: None, **options)
    collector.require_all(dependencies, {""}, "demo")
    collector.collect()
    return collector


def test_the_target_has_is_skipped_and_torch_is_never_collected_by_default(tmp_path):
    have = {"torch": Version("2.11.0"), "numpy": Version("2.0.1")}
    collector = walk(tmp_path, ["torch>=2.6", "numpy>=1.26", "numpy<3", "triton", "nvidia-nccl-cu12", "wandb"],
                     have, excluded=["WandB"])
    assert collector.on_target == have and collector.wheels == {}
    assert set(collector.left_out) == {"triton", "nvidia-nccl-cu12", "wandb"}
    assert "--include-torch" in collector.left_out["triton"] and collector.left_out["wandb"] == "--exclude"


def test_a_torch_on_the_target_too_old_is_an_error_not_a_download(tmp_path):
    with pytest.raises(WheelhouseError, match=r"torch 2\.4\.0 on the target does not satisfy torch>=2\.6"):
        walk(tmp_path, ["torch>=2.6"], {"torch": Version("2.4.0")})


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """pip sees only this folder of wheels: no index, no config files."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    return links


def test_a_package_pip_cannot_find_names_it_and_leaves_no_wheelhouse(tmp_path, local_index):
    project = make_project(tmp_path / "project", ["missing-package>=1"])
    with pytest.raises(WheelhouseError, match=r"no wheel of missing-package>=1 \(wanted by demo\).*--exclude"):
        wheelhouse.build_wheelhouse(project, X86_312, {}, tmp_path / "wheels", log=lambda line: None)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["links", "project"]


def test_walk_with_pip_collects_what_the_target_lacks_and_its_extras(tmp_path, local_index):
    make_wheel(local_index, "alpha", "1.0", ("beta>=1", "gamma[fast]", "old-only; python_version < '3.11'"))
    make_wheel(local_index, "gamma", "2.0", ("delta; extra == 'fast'", "epsilon"))
    make_wheel(local_index, "delta", "3.0")
    destination = tmp_path / "wheels"
    destination.mkdir()
    (destination / "stale-0.1-py3-none-any.whl").write_text("an earlier run's")
    project = make_project(tmp_path / "project", ["alpha>=1"])
    have = {"beta": Version("1.5"), "gamma": Version("2.0"), "epsilon": Version("1.0")}
    collector = wheelhouse.build_wheelhouse(project, X86_312, have, destination, log=lambda line: None)
    assert sorted(path.name for path in destination.iterdir()) == [
        "alpha-1.0-py3-none-any.whl", "delta-3.0-py3-none-any.whl", "requirements.txt"]
    manifest = (destination / "requirements.txt").read_text().splitlines()
    assert [line for line in manifest if not line.startswith("#")] == ["alpha==1.0", "delta==3.0"]
    assert f"--find-links {destination}" in manifest[2]
    assert set(collector.on_target) == {"beta", "gamma"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["links", "project", "wheels"]


@pytest.mark.skipif(os.environ.get("SCALETRAIN_WHEELHOUSE_PYPI") != "1", reason="reaches PyPI: set "
                    "SCALETRAIN_WHEELHOUSE_PYPI=1")
def test_pypi_wheels_for_python_3_12(tmp_path):
    project = make_project(tmp_path / "project", ["webdataset>=0.2.86", "torch>=2.6", "numpy", "pyyaml"])
    have = {"numpy": Version("2.3.4"), "pyyaml": Version("6.0.3")}
    wheelhouse.build_wheelhouse(project, X86_312, have, tmp_path / "wheels", log=lambda line: None)
    names = sorted(line.split("==")[0] for line in (tmp_path / "wheels" / "requirements.txt").read_text().splitlines()
                   if not line.startswith("#"))
    assert names == ["braceexpand", "webdataset"]
