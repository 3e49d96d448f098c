"""The images' contents, checked on CPU without a container runtime.

Each Dockerfile's build context is assembled into a temporary directory exactly as its COPY
lines do, and the image's entry point is imported there in a fresh interpreter that sees only
those files plus the installed third-party packages (``python -S``: no site hooks, so the
editable install of this checkout cannot leak in). A module the Dockerfile forgets to copy
fails the import here as it would fail the image build.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


@dataclass(frozen=True)
class Dockerfile:
    copies: list[tuple[list[str], str]]  # (sources relative to the context, destination)
    workdir: str
    cmd: list[str]


def parse(path: Path) -> Dockerfile:
    """The COPY, WORKDIR and CMD instructions (continuation lines joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    copies, workdir, cmd = [], "/", []
    for line in lines:
        op, _, rest = line.partition(" ")
        if op == "WORKDIR":
            workdir = rest.strip()
        elif op == "COPY":
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            copies.append((words[:-1], words[-1]))
        elif op == "CMD":
            cmd = json.loads(rest)
    return Dockerfile(copies, workdir, cmd)


def assemble(dockerfile: Dockerfile, into: Path) -> Path:
    """Copy what the COPY lines copy; returns the WORKDIR inside ``into``."""
    workdir = into / dockerfile.workdir.lstrip("/")
    workdir.mkdir(parents=True, exist_ok=True)
    for sources, dest in dockerfile.copies:
        target = workdir / dest if not dest.startswith("/") else into / dest.lstrip("/")
        for src in sources:
            origin = ROOT / src
            if origin.is_dir():
                shutil.copytree(
                    origin, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                where = target if dest.endswith("/") else target.parent
                where.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, where / origin.name if dest.endswith("/") else target)
    return workdir


def run_in_context(workdir: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in an interpreter whose epd_* packages are only the assembled ones.

    ``pip install .`` installs the packages setuptools finds under engine/ and operator/
    (pyproject: ``packages.find where``), so those two folders stand for the installed project.
    """
    path = [str(workdir / "engine"), str(workdir / "operator"), *site.getsitepackages()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True, text=True, timeout=120, cwd=workdir, env=env,
    )  # fmt: skip


def module_after_dash_m(cmd: list[str]) -> str:
    return cmd[cmd.index("-m") + 1]


def test_operator_image_contains_every_module_its_entry_point_imports(tmp_path: Path) -> None:
    """Defect: operator.Dockerfile copied three files of epd_engine, but epd_operator.kube.handlers
    imports epd_engine.transfer and epd_engine.profiler, so the image build failed."""
    dockerfile = parse(DOCKER / "operator.Dockerfile")
    entry = module_after_dash_m(dockerfile.cmd)
    assert entry == "epd_operator.kube.handlers"
    workdir = assemble(dockerfile, tmp_path)
    # No torch in the operator image: an import of it fails here as it would there.
    proc = run_in_context(
        workdir,
        f"import sys; sys.modules['torch'] = None; import {entry}; "
        "import epd_operator.kube.handlers as h; print(h.__file__)",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(workdir)), proc.stdout


def test_chart_runs_the_module_the_operator_image_holds() -> None:
    template = (ROOT / "charts" / "epd-operator" / "templates" / "deployment.yaml").read_text()
    entry = module_after_dash_m(parse(DOCKER / "operator.Dockerfile").cmd)
    assert f"-m, {entry}," in template


def test_engine_image_runs_epdctl(tmp_path: Path) -> None:
    """The engine image's build step (``epdctl --help``) and its serve/router commands."""
    workdir = assemble(parse(DOCKER / "engine.Dockerfile"), tmp_path)
    proc = run_in_context(
        workdir,
        "import epd_engine.cli as c, sys; print(c.__file__); "
        "sys.argv = ['epdctl', '--help']; c.main(['--help'])",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].startswith(str(workdir))
    for command in ("serve", "router"):
        assert command in proc.stdout


@pytest.mark.parametrize("name", ["engine.Dockerfile", "operator.Dockerfile"])
def test_base_image_is_a_build_argument(name: str) -> None:
    text = (DOCKER / name).read_text()
    assert "ARG BASE=python:3.12-slim" in text
    assert "FROM ${BASE}" in text


# --- the GPU variant (VARIANT=gpu: `make images-gpu`, tests/images/test_gpu_image.py) -----------

GPU_FILES = (
    "requirements-gpu-build.lock",
    "tools/images/gpu_kernels.sh",
    "tools/images/flashinfer_aot.py",
    "requirements-gpu.lock",
)


def test_engine_dockerfile_builds_gpu_kernels_before_anything_they_do_not_need(
    tmp_path: Path,
) -> None:
    """The gpu variant's kernel step comes first and reads only requirements-gpu-build.lock
    and its scripts (a change to another lock or to the code rebuilds no kernel: hours on 2
    cores); every file the GPU steps run is in their COPY context; the cpu variant skips them."""
    text = (DOCKER / "engine.Dockerfile").read_text()
    order = [
        "ARG VARIANT=cpu",
        "COPY requirements-gpu-build.lock tools/images/gpu_kernels.sh",
        "gpu) sh gpu_kernels.sh ;;",
        "COPY requirements-gpu.lock ./",
        "COPY requirements.lock ./",
        "COPY engine/ engine/",
    ]
    assert [text.index(step) for step in order] == sorted(text.index(step) for step in order)
    assert "cpu) ;;" in text
    workdir = assemble(parse(DOCKER / "engine.Dockerfile"), tmp_path)
    for name in GPU_FILES:
        assert (workdir / Path(name).name).is_file(), name


def test_the_kernel_step_removes_exactly_the_toolchain() -> None:
    """gpu_kernels.sh uninstalls the build lock's packages that no other lock installs (nvcc
    and its headers), and nothing the image keeps."""
    from tests.images.test_gpu_image import pins

    script = (ROOT / "tools/images/gpu_kernels.sh").read_text()
    toolchain = set(script.split('TOOLCHAIN="')[1].split('"')[0].split())
    build, gpu = pins("requirements-gpu-build.lock"), pins("requirements-gpu.lock")
    assert toolchain == set(build) - set(gpu)


def test_gpu_locks_pin_what_the_base_lock_pins() -> None:
    """The GPU image installs requirements.lock, then requirements-gpu.lock over it: a package
    both pin must have one version (else the second install silently changes the first)."""
    from tests.images.test_gpu_image import pins

    locks = ("requirements.lock", "requirements-gpu.lock", "requirements-gpu-build.lock")
    base, gpu, build = (pins(f) for f in locks)
    for name, version in gpu.items():
        assert base.get(name, version) == version, (name, base[name], version)
    for name, version in build.items():
        assert gpu.get(name, version) == version, (name, gpu[name], version)
    for name in ("torch", "flashinfer-python", "cupy-cuda13x", "nvidia-ml-py"):
        assert name in gpu, name
    # nvcc compiles for the CUDA torch was built with (13.0); the kernel step's torch and
    # FlashInfer are the image's
    torch_cuda = base["nvidia-cuda-runtime"].split(".")[:2]
    assert build["nvidia-cuda-nvcc"].split(".")[:2] == torch_cuda
    assert build["torch"] == base["torch"]
    assert build["flashinfer-python"] == gpu["flashinfer-python"]
    assert "nixl-cu13" in gpu  # the nixl transfer backend, in the GPU image for sure


def test_flashinfer_kernels_built_in_are_those_the_engine_runs() -> None:
    import importlib.util

    import torch

    from epd_engine.model import attention_flashinfer, flashinfer_plan

    spec = importlib.util.spec_from_file_location("aot", ROOT / "tools/images/flashinfer_aot.py")
    assert spec is not None and spec.loader is not None
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    # head size 128 only (the other sizes get torch attention in the image, with the reason):
    # every supported family's, the 7B preset's among them
    from epd_engine.model.presets import LLAVA_15_7B

    text = LLAVA_15_7B.text_config
    assert text["hidden_size"] // text["num_attention_heads"] in aot.HEAD_DIMS
    assert set(aot.HEAD_DIMS) <= set(flashinfer_plan.SUPPORTED_HEAD_DIMS)
    assert tuple(getattr(torch, d) for d in aot.DTYPES) == flashinfer_plan.SUPPORTED_DTYPES
    assert attention_flashinfer.PREFILL_BACKEND == "fa2"  # the only prefill backend built
    assert attention_flashinfer.KV_LAYOUT == "NHD"
