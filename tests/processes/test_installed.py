"""The product as users get it: the sdist and the wheel built from it, installed into a fresh
venv, and run from a folder outside the checkout.

Nothing here may reach the checkout: the venv is made without system site-packages, the
commands run with ``PYTHONPATH`` unset and their working folder elsewhere, and the first test
proves that ``torchtop`` is imported from the venv's site-packages. torch and the other
dependencies come from where the set-up takes them (the same local files and index).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, tmux
from torchtop.protocol import OutOfMemory
from torchtop.streams.recording import read_recording

pytestmark = pytest.mark.slow

#: Folders of the tree and where their files land in the wheel.
PACKAGE_ROOTS = {"torchtop": "torchtop", "demos": "torchtop/demos"}


def tree_files() -> set[str]:
    """Every file of the packages' folders, named by where the wheel must hold it."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *PACKAGE_ROOTS],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if listed.returncode == 0 and listed.stdout.strip():
        paths = [p for p in listed.stdout.splitlines() if (REPO / p).is_file()]
    else:  # not a git checkout (an unpacked sdist): every file but byte code
        paths = [
            str(p.relative_to(REPO))
            for root in PACKAGE_ROOTS
            for p in (REPO / root).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        ]
    out = set()
    for path in paths:
        root, _, rest = path.partition("/")
        out.add(f"{PACKAGE_ROOTS[root]}/{rest}")
    return out


@dataclass
class Installed:
    venv: Path
    wheel: Path
    work: Path
    env: dict[str, str]

    @property
    def environ(self) -> dict[str, str]:
        """The venv's environment, with this test's own runtime and tmux folders."""
        own = ("TORCHTOP_RUNTIME_DIR", "TMUX_TMPDIR")
        return {**self.env, **{k: os.environ[k] for k in own if k in os.environ}}

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.environ,
            cwd=self.work,
        )

    def torchtop(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / "torchtop"), *args, timeout=timeout)

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, and the wheel built from it, as a release would build them."""
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("installed")
    venv, work = base / "venv", base / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = dist.glob("torchtop-*.whl")
    # torch as the set-up installs it (the CPU file on a CPU machine), so no other build is
    # fetched; the rest from the wheel's own requirements.
    torch = f"torch=={importlib.metadata.version('torch')}"
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", torch, "numpy", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=work,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = {
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", str(base)),
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
        "TMPDIR": str(base),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
    }
    return Installed(venv=venv, wheel=wheel, work=work, env=env)


def test_the_wheel_holds_every_package_and_data_file_of_the_tree(dist: Path) -> None:
    (wheel,) = dist.glob("torchtop-*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if not n.startswith("torchtop-")}
    expected = tree_files()
    assert "torchtop/tui/app.tcss" in expected and "torchtop/demos/oom.py" in expected
    missing = sorted(expected - held)
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the tree: {missing}"
    extra = sorted(n for n in held - expected if not n.endswith("/"))
    assert not extra, f"the wheel holds files the tree does not: {extra}"
    (sdist,) = dist.glob("torchtop-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.partition("/")[2] for n in t.getnames()}
    assert {"setup.py", "MANIFEST.in", "pyproject.toml", "README.md"} <= names


def test_the_installed_torchtop_is_the_wheels_and_says_its_version(installed: Installed) -> None:
    where = installed.run(installed.python, "-c", "import torchtop; print(torchtop.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout
    assert not Path(where.stdout.strip()).is_relative_to(REPO)
    meta = installed.run(
        installed.python, "-c", "import importlib.metadata as m; print(m.version('torchtop'))"
    )
    version = installed.torchtop("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"torchtop {meta.stdout.strip()}"
    assert installed.wheel.name.startswith(f"torchtop-{meta.stdout.strip()}-")


def test_run_record_and_report_from_the_installed_wheel(installed: Installed) -> None:
    script = installed.work / "train.py"
    shutil.copy(SCRIPTS / "train_mlp.py", script)
    run = installed.torchtop("run", "--headless", "--record", "r.ttr", "train.py", "--steps", "20")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = installed.torchtop("report", "r.ttr", "--json")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["steps"] == 20
    assert data["exit_code"] == 0
    version = installed.torchtop("--version").stdout.split()[-1]
    assert data["torchtop_version"] == version
    text = installed.torchtop("report", "r.ttr")
    assert text.returncode == 0 and "20" in text.stdout, text.stderr


def test_demos_run_from_the_installed_wheel_and_an_oom_points_at_the_demos_line(
    installed: Installed,
) -> None:
    demo = installed.torchtop("demo", "broadcasting", "--headless", "--quick", timeout=300)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "broadcast" in demo.stdout.lower()
    oom = installed.torchtop("demo", "oom", "--headless", "--quick", "--record", "oom.ttr")
    assert oom.returncode == 0, oom.stdout[-2000:] + oom.stderr[-2000:]
    (event,) = [
        m for m in read_recording(installed.work / "oom.ttr").messages if isinstance(m, OutOfMemory)
    ]
    # The demos are the job's code, not a library, though they live in site-packages: the site
    # that held the memory and the failing line are the demo's.
    demos = str(installed.venv) + os.sep
    assert event.top_sites and event.top_sites[0].file.startswith(demos), event.top_sites
    assert "/torchtop/demos/" in event.top_sites[0].file
    outside_torch = [f for f in event.requested_stack if f"{os.sep}torch{os.sep}" not in f.file]
    assert outside_torch and "/torchtop/demos/" in outside_torch[0].file, event.requested_stack


def test_a_torchrun_job_of_two_ranks_from_the_installed_wheel(installed: Installed) -> None:
    shutil.copy(SCRIPTS / "ddp.py", installed.work / "ddp.py")
    run = installed.torchtop(
        "run", "--headless", "--record", "ranks.ttr",
        "torchrun", "--standalone", "--nproc_per_node=2", "ddp.py", "--steps", "4",
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = installed.torchtop("report", "ranks.ttr", "--json")
    assert report.returncode == 0, report.stderr
    ranks = json.loads(report.stdout)["ranks"]
    # Each rank's agent started from the wheel's sitecustomize: no checkout is on any path.
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert [r["steps"] for r in ranks] == [4, 4]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_installed_viewer_in_a_real_terminal(installed: Installed) -> None:
    shutil.copy(SCRIPTS / "train_mlp.py", installed.work / "view.py")
    session = f"torchtop-installed-{uuid.uuid4().hex[:8]}"
    command = "torchtop run view.py --steps 400 --sleep 0.02; echo EXIT=$?"
    tmux(
        "new-session", "-d", "-s", session, "-x", "160", "-y", "30", "-c", str(installed.work),
        "bash", "--norc", "--noprofile", env=installed.environ,
    )  # fmt: skip

    def screen() -> str:
        return tmux(
            "capture-pane", "-p", "-J", "-t", session, check=False, env=installed.environ
        ).stdout

    def wait_for(pattern: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        shown = ""
        while time.monotonic() < deadline:
            shown = screen()
            if re.search(pattern, shown):
                return shown
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {pattern!r}; the screen shows:\n{shown}")

    try:
        tmux("send-keys", "-t", session, command, "Enter", env=installed.environ)
        # The header comes in the first frame, the panels in the next ones: wait for all.
        live = wait_for(r"(?s)(?=.*Host)(?=.*RSS)(?=.*view\.py).*running .*pid \d+")
        assert "view.py" in live and "Host" in live and "RSS" in live
        wait_for(r"step \d+ loss")
        tmux("send-keys", "-t", session, "q", env=installed.environ)
        wait_for(r"still running")
        tmux("send-keys", "-t", session, "s", env=installed.environ)
        wait_for(r"EXIT=\d+", timeout=30)
    finally:
        tmux("kill-session", "-t", session, check=False, env=installed.environ)


def test_the_otel_extra_installs_and_pushes(installed: Installed) -> None:
    from tests.processes.test_export_otlp import Receiver, points, serving

    extra = installed.run(
        str(installed.venv / "bin" / "pip"), "install", "-q", f"{installed.wheel}[otel]",
        timeout=600,
    )  # fmt: skip
    assert extra.returncode == 0, extra.stderr[-3000:]
    shutil.copy(SCRIPTS / "train_metrics.py", installed.work / "metrics.py")
    with serving(Receiver()) as receiver:
        run = installed.torchtop(
            "run", "--headless", "--otlp", receiver.endpoint, "--otlp-interval", "1",
            "metrics.py", "--steps", "10", "--tail", "1",
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert receiver.requests, run.stderr[-2000:]
        ((steps, _),) = points(receiver.requests[-1])["torchtop_steps"]
        assert steps == 10


def test_doctor_from_the_installed_wheel(installed: Installed) -> None:
    out = installed.torchtop("doctor", "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    torch = installed.run(installed.python, "-c", "import torch; print(torch.__version__)")
    assert checks["torch"]["status"] == "ok"
    assert checks["torch"]["detail"].startswith(torch.stdout.strip() + ",")
    assert checks["torchtop"]["detail"].startswith(
        installed.torchtop("--version").stdout.split()[-1]
    )


#: Pythons other than the one the suite runs on. torch wheels for them are not on this machine's
#: disk (the registry's are multi-GB CUDA builds), so there the wheel is installed with every
#: requirement but torch and the commands that need no torch are run.
OTHER_PYTHONS = ("3.10", "3.12", "3.13")


def _find_python(version: str) -> str | None:
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(pyenv.glob(f"{version}.*/bin/python{version}"))
    if candidates:
        return str(candidates[-1])
    found = shutil.which(f"python{version}")
    # pyenv's shims answer for every version and fail for those not selected.
    return found if found and "/shims/" not in found else None


@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_the_wheel_on_another_python_without_torch(
    version: str, installed: Installed, tmp_path: Path
) -> None:
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        pytest.skip(f"the suite itself runs on {version}")
    python = _find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (looked on PATH and in pyenv)")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    with zipfile.ZipFile(installed.wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    others = [r for r in requires if not re.match(r"torch\b", r)]
    assert len(others) == len(requires) - 1, requires
    pip = str(venv / "bin" / "pip")
    install = installed.run(pip, "install", "-q", "--no-deps", str(installed.wheel), timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    install = installed.run(pip, "install", "-q", *others, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out = installed.run(*args)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
        return out

    py = str(venv / "bin" / "python")
    # Every module is valid for this Python, and every module that needs no torch imports.
    run(py, "-m", "compileall", "-q", str(Path(run(py, "-c", _WHERE).stdout.strip()).parent))
    run(py, "-c", "import " + ", ".join(TORCH_FREE_MODULES))
    tt = str(venv / "bin" / "torchtop")
    assert run(tt, "--version").stdout == installed.torchtop("--version").stdout
    checks = {c["name"]: c for c in json.loads(run(tt, "doctor", "--json").stdout)["checks"]}
    assert checks["python"]["detail"].startswith(version + ".")
    assert checks["torch"]["status"] == "missing"
    # A recording made by a job on the suite's Python reads the same here.
    shutil.copy(SCRIPTS / "train_mlp.py", installed.work / "other.py")
    recorded = installed.torchtop(
        "run", "--headless", "--record", f"other-{version}.ttr", "other.py", "--steps", "5"
    )
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    here = json.loads(installed.torchtop("report", f"other-{version}.ttr", "--json").stdout)
    there = json.loads(run(tt, "report", f"other-{version}.ttr", "--json").stdout)
    assert there == here and there["steps"] == 5


_WHERE = "import torchtop; print(torchtop.__file__)"

#: What runs without torch: the command line, the viewer, the model, reports and exporters.
TORCH_FREE_MODULES = (
    "torchtop.commands",
    "torchtop.tui.app",
    "torchtop.tui.screens.run",
    "torchtop.model",
    "torchtop.report.job",
    "torchtop.export.service",
    "torchtop.export.prometheus",
    "torchtop.streams.relay",
    "torchtop.streams.nodes",
    "torchtop.commands.doctor",
)
