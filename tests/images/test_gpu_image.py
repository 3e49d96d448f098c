"""The GPU engine image (``make images-gpu``), inspected on CPU inside the built image.

It runs as the image's user (10001): torch is the locked CUDA 13.0 build, FlashInfer, CuPy
(with NCCL) and NVML's bindings import, every FlashInfer kernel module the engine runs loads
from the image's AOT directory with FlashInfer's JIT off (so a pod compiles nothing), and
``epdctl serve --help`` works. The image comes from buildah's store (root; what
``tools/images/build.sh engine-gpu`` builds) or, failing that, a Docker daemon.

Skips with a reason when the image is not built (CI does not build it: docs/gpu.md, "The GPU
image"); ``EPD_REQUIRE_GPU_IMAGE=1`` (``make images-gpu``) turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = f"epd-engine-gpu:{os.environ.get('IMAGE_TAG', 'dev')}"
BUILDAH = ["buildah", "--storage-driver", os.environ.get("BUILDAH_STORAGE", "overlay")]
USER = "10001"


def pins(lock: str) -> dict[str, str]:
    """name -> version of a uv lock file."""
    out = {}
    for line in (ROOT / lock).read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            out[name.strip().lower()] = version.split(";")[0].strip()
    return out


def _buildah_has_image() -> bool:
    if shutil.which("buildah") is None or os.geteuid() != 0:
        return False
    probe = [*BUILDAH, "inspect", "--type", "image", IMAGE]
    return subprocess.run(probe, capture_output=True).returncode == 0


def _docker_has_image() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = ["docker", "image", "inspect", IMAGE]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def run_in_image() -> Iterator:
    """``run(cmd)``: ``cmd`` (argv) in one container of the image, as user 10001."""
    if _buildah_has_image():
        ctr = subprocess.run(
            [*BUILDAH, "from", "--quiet", IMAGE], capture_output=True, text=True, check=True
        ).stdout.strip()

        def run(cmd: list[str]) -> subprocess.CompletedProcess:
            argv = [*BUILDAH, "run", "--isolation", "chroot", "--user", USER, ctr, "--", *cmd]
            return subprocess.run(argv, capture_output=True, text=True, timeout=300)

        try:
            yield run
        finally:
            subprocess.run([*BUILDAH, "rm", ctr], capture_output=True)
        return
    if _docker_has_image():

        def run(cmd: list[str]) -> subprocess.CompletedProcess:
            argv = ["docker", "run", "--rm", "--user", USER, IMAGE, *cmd]
            return subprocess.run(argv, capture_output=True, text=True, timeout=300)

        yield run
        return
    reason = f"{IMAGE} is not built (make images-gpu; buildah's store needs root)"
    if os.environ.get("EPD_REQUIRE_GPU_IMAGE") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


PROBE = """
import json, os, sys, torch, flashinfer, cupy, pynvml
from cupy.cuda import nccl
print(json.dumps({
    "uid": os.getuid(), "home": os.path.expanduser("~"), "python": sys.version.split()[0],
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "flashinfer": flashinfer.__version__, "cupy": cupy.__version__,
    "nccl": nccl.get_version(),
}))
"""


def test_gpu_image_holds_the_locked_gpu_stack(run_in_image) -> None:
    proc = run_in_image(["python", "-c", PROBE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    gpu = pins("requirements-gpu.lock")
    assert found["uid"] == int(USER)
    assert found["torch"].split("+")[0] == gpu["torch"]
    assert found["cuda"] == "13.0"  # the driver floor in docs/gpu.md (>= 580) follows from it
    assert found["cuda_available"] is False  # no GPU here: everything above ran on CPU
    assert found["flashinfer"] == gpu["flashinfer-python"]
    assert found["cupy"] == gpu["cupy-cuda13x"]
    assert found["nccl"] // 100 == int("".join(gpu["nvidia-nccl-cu13"].split(".")[:2]))


def test_gpu_image_flashinfer_kernels_load_without_compiling(run_in_image) -> None:
    """Every module the engine asks FlashInfer for is built in: with the JIT off, each loads
    from the AOT directory (no nvcc in the image; a missing one would name itself here)."""
    proc = run_in_image(["python", "/app/flashinfer_aot.py", "check"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "FlashInfer modules load from" in proc.stdout
    # Every symbol binds now, on a machine without the driver: the modules were linked with an
    # empty libcuda stub (tools/images/gpu_kernels.sh), so one calling the driver would fail here
    # instead of at its first launch on a GPU.
    bind_all = (
        "import ctypes, os, glob, torch, flashinfer.jit.env as e; "
        "sos = glob.glob(f'{e.FLASHINFER_AOT_DIR}/*/*.so'); "
        "[ctypes.CDLL(so, mode=os.RTLD_NOW) for so in sos]; print(len(sos), 'bound')"
    )
    proc = run_in_image(["python", "-c", bind_all])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) >= 7, proc.stdout
    nvcc = run_in_image(["sh", "-c", "command -v nvcc c++ g++ || true"])
    assert nvcc.stdout.strip() == "", f"toolchain left in the image: {nvcc.stdout}"


ENGINE_VIEW = """
import os, sys, torch
os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "8.0"  # no GPU to ask: FlashInfer's specs need one
sys.path.insert(0, "/app")
import flashinfer_aot
from epd_engine.model.attention_select import select_attention_backend
from epd_engine.model.flashinfer_kernels import kernel_modules, missing_kernels_reason
built = {spec.name for spec in flashinfer_aot.engine_specs()}
wanted = {m for h in flashinfer_aot.HEAD_DIMS for d in flashinfer_aot.DTYPES
          for m in kernel_modules(h, getattr(torch, d))}
assert built == wanted, (sorted(built ^ wanted))
for dtype in (torch.float16, torch.bfloat16):
    assert missing_kernels_reason(128, dtype) is None, dtype
    assert select_attention_backend("cuda", "auto", dtype, 128, lambda: None) == "flashinfer"
why = missing_kernels_reason(64, torch.float16)
assert why is not None and "not built in" in why and "no nvcc" in why, why
assert select_attention_backend("cuda", "auto", torch.float16, 64, lambda: None) == "torch"
print("engine view ok:", len(built), "modules")
"""


def test_the_engine_finds_the_built_kernels_and_falls_back_without_them(run_in_image) -> None:
    """The names the engine looks up are the modules the image built; head size 128 picks
    FlashInfer, 64 (not built, no nvcc) falls back to torch with the reason (on CPU, the
    device check is given: only the kernel lookup differs)."""
    proc = run_in_image(["python", "-c", ENGINE_VIEW])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "engine view ok" in proc.stdout


def test_gpu_image_serves_as_non_root(run_in_image) -> None:
    proc = run_in_image(["epdctl", "serve", "--help"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--attention-backend" in proc.stdout
    assert "--device" in proc.stdout
