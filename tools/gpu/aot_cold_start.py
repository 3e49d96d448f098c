"""The GPU image's FlashInfer on a GPU: a cold instance compiles nothing and serves.

The GPU image (``docker/engine.Dockerfile``, ``VARIANT=gpu``) carries FlashInfer's kernels
built ahead of time in FlashInfer's AOT directory (``tools/images/flashinfer_aot.py``). Here,
in the same locked Python environment (``.whl/`` from requirements-gpu.lock), the AOT
directory is filled the same way: from ``.fi/aot.tgz`` (the image's own kernels,
``tools/images/export_aot.sh``) when carried, else built on this machine for its GPU with the
same script. Then one ``epdctl serve`` starts cold -- an empty ``HOME`` (no JIT cache) and
``FLASHINFER_DISABLE_JIT=1``, so a kernel missing from the AOT directory fails the request
instead of compiling -- and the check records start -> ready and the time to first token of
one streamed completion. Writes ``$OUT/aot-cold-start.json``; exits 1 on a failure.

    python tools/gpu/aot_cold_start.py --model /tmp/llava-1.5-7b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
AOT_SCRIPT = ROOT / "tools" / "images" / "flashinfer_aot.py"


def fill_aot_dir(tarball: Path) -> dict[str, object]:
    """The image's kernels from ``tarball``, else built here for this GPU."""
    import flashinfer.jit.env as jit_env
    import torch

    aot = Path(jit_env.FLASHINFER_AOT_DIR)
    start = time.perf_counter()
    if tarball.is_file():
        aot.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(aot, filter="data")
        source = f"{tarball} (the image's)"
    else:
        major, minor = torch.cuda.get_device_capability()
        env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": f"{major}.{minor}",
               "CXX": "c++ -Wl,--as-needed"}  # fmt: skip
        subprocess.run([sys.executable, str(AOT_SCRIPT), "build"], check=True, env=env)
        source = f"built here for sm_{major}{minor} (no {tarball})"
    return {"aot_dir": str(aot), "aot_source": source,
            "aot_fill_s": round(time.perf_counter() - start, 1)}  # fmt: skip


def first_token_s(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "stream": True}  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint with head size 128")
    ap.add_argument("--aot-tarball", type=Path, default=ROOT / ".fi" / "aot.tgz")
    ap.add_argument("--port", type=int, default=8123)
    out_dir = Path(os.environ.get("OUT", "."))
    ap.add_argument("--out", type=Path, default=out_dir / "aot-cold-start.json")
    args = ap.parse_args()

    result: dict[str, object] = fill_aot_dir(args.aot_tarball)
    check_cmd = [sys.executable, str(AOT_SCRIPT), "check"]
    check = subprocess.run(check_cmd, capture_output=True, text=True)
    result["aot_check"] = (check.stdout + check.stderr).strip()
    home = Path(tempfile.mkdtemp(prefix="cold-home-"))
    log = Path(args.out).with_suffix(".log")
    env = {**os.environ, "HOME": str(home), "FLASHINFER_DISABLE_JIT": "1"}
    env.pop("FLASHINFER_CUDA_ARCH_LIST", None)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "epd_engine", "serve", "--model", str(args.model),
           "--served-model-name", "m", "--device", "cuda", "--dtype", "float16",
           "--port", str(args.port)]  # fmt: skip
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    ok = False
    try:
        while time.perf_counter() - start < 600:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}")
            try:
                ready = httpx.get(f"{url}/health/ready", timeout=2)
                if ready.status_code == 200:
                    result["startup"] = ready.json().get("startup")
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        result["start_to_ready_s"] = round(time.perf_counter() - start, 1)
        result["ttft_cold_s"] = round(first_token_s(url, "m"), 3)
        result["ttft_warm_s"] = round(first_token_s(url, "m"), 3)
        text = log.read_text()
        result["attention_flashinfer"] = "attention backend: flashinfer" in text
        result["jit_cache_files"] = sum(1 for _ in (home / ".cache" / "flashinfer").rglob("*.so"))
        ok = bool(result["attention_flashinfer"]) and result["jit_cache_files"] == 0
    except Exception as exc:  # recorded with the log's tail
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log_tail"] = log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)
    result["ok"] = ok and check.returncode == 0
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
