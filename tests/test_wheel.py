"""The built wheel works on its own: `controller demo` runs from the installed files alone.

An editable install reads data files straight from the source tree, so a file that
``[tool.setuptools.package-data]`` forgets (a bundled policy, a deployment's JSON) is only
missed by users of the wheel. This test builds the wheel from a fresh copy of the working tree
(no stale ``build/``), installs it with ``--no-deps --target`` (its dependencies come from the
running environment: no network, no torch reinstall), and runs the installed console script
from an empty directory, checking that every project module it imports and the policy it
serves come from the install, not from the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("controller", "env", "agents", "sglang_hook")


def _copy_tree(dst: Path) -> None:
    """Copy what a clean clone would build from: tracked and untracked-but-not-ignored files."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): take it all
        ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "runs")
        shutil.copytree(REPO, dst, ignore=ignore)
        return
    for name in names:
        src = REPO / name
        if src.is_file():  # a deleted-but-tracked file is listed too
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel and install it (no deps) into a target folder; return that folder."""
    root = tmp_path_factory.mktemp("wheel")
    src, dist, site = root / "src", root / "dist", root / "site"
    _copy_tree(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # No build isolation: it would fetch setuptools from an index; the dev environment has it.
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", str(dist)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("specdepth-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    return site


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # ahead of the dev environment's editable finder
    env["NUMBA_CACHE_DIR"] = str(site.parent / "numba-cache")
    return env


@pytest.mark.slow
def test_wheel_ships_bundled_data_and_entry_points(installed: Path) -> None:
    for deployment in ("h200-llama8b", "seed"):
        assert (installed / "agents" / "bundled" / deployment / "ppo.zip").is_file()
        assert (installed / "env" / "deployments" / f"{deployment}.json").is_file()
        assert list((installed / "env" / "example_traces" / deployment).glob("*.msgpack.gz"))
    for package in PACKAGES:
        assert (installed / package / "py.typed").is_file(), package
    (dist_info,) = installed.glob("specdepth-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "controller = controller.cli:main" in entry_points
    assert "[sglang.srt.plugins]" in entry_points and "sglang_hook.plugin:register" in entry_points
    metadata = (dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata


@pytest.mark.slow
def test_demo_runs_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    env = _env(installed)
    work = tmp_path / "cwd"  # an empty cwd: nothing of the repository is importable from here
    work.mkdir()

    # Every project module the demo and the server import resolves inside the install.
    probe = (
        "import json, sys\n"
        "import controller.cli, agents.demo, controller.service, controller.ppo_policy\n"
        "import env.deployments, env.runner, controller.baselines, sglang_hook.plugin, sglang_hook.off_switch\n"
        "mods = {n: m.__file__ for n, m in sys.modules.items()\n"
        f"        if n.split('.')[0] in {PACKAGES!r} and getattr(m, '__file__', None)}}\n"
        "print(json.dumps(mods))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    mods = json.loads(proc.stdout)
    assert len(mods) > 10, mods
    outside = {n: f for n, f in mods.items() if not Path(f).resolve().is_relative_to(installed.resolve())}
    assert not outside, f"imported from outside the installed wheel: {outside}"

    script = installed / "bin" / "controller"
    assert script.is_file(), "the wheel installs no `controller` console script"
    # A short run: the same code path as `./scripts/demo.sh`, a third of its simulated time.
    proc = subprocess.run(
        [str(script), "demo", "--duration-s", "10", "--workload", "ramp:1,40,8@output=256"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bundled = installed / "agents" / "bundled" / "h200-llama8b" / "ppo.zip"
    assert zipfile.is_zipfile(bundled)
    # The demo names the policy it serves: the bundled zip inside the install.
    served = {f"serving {bundled} ", f"serving {bundled.resolve()} "}
    assert any(s in proc.stdout for s in served), proc.stdout[:2000]
    assert (work / "runs" / "demo").is_dir(), "the demo records its trace under the cwd"
    assert str(REPO) not in proc.stdout + proc.stderr
