"""Served decode throughput: one EPD instance through its OpenAI endpoint vs ``generate``.

Output tokens/s of ``/v1/completions`` (token-id prompts, greedy, ``ignore_eos``, a fixed
``max_tokens`` and as many ``min_tokens``; every request of a batch sent at once, wall time
from the first send to the last answer) next to ``transformers`` ``generate`` on the same
checkpoint, prompts, batch, token count and torch thread count, in this process. Both
figures include the prefill.
On a GPU (``--device cuda``) both sides run there in ``--dtype`` (the instance with its
own defaults: FlashInfer and decode CUDA graphs where the model's head size allows them),
and ``generate``'s time ends with a device synchronisation.
With ``--before-ref`` a second instance runs an earlier commit's code (exported with ``git
archive``, first on ``PYTHONPATH``) and the rounds alternate between the trees, so the
after/before ratios see the same host load; ``--after-args`` / ``--before-args`` add serve
flags to either side (with ``--before-args`` alone both sides run this tree: a flag's A/B).
``--stream`` streams every answer (server-sent events, usage in the last chunk); the client
keeps the bytes and parses them once the clock has stopped.
Each round measures every side once per batch; the JSON keeps every round and per batch the
median, min and max of each ratio. Greedy text is checked against ``generate``'s tokens
decoded with the same tokenizer. Around each run the instance's ``/metrics`` is read (off
the clock), and the JSON keeps how many decode steps the run took and the mean time of each
phase of them (``epd_step_phase_seconds``: schedule, launch, wait for the device, update,
publish), so a GPU run says whether its steps wait for the device or for the host.

    python benchmarks/bench_served.py --model models/tiny-llava --before-ref main \\
        --out benchmarks/results/served-cpu.json
    python benchmarks/bench_served.py --model /tmp/llava-1.5-7b --device cuda \\
        --dtype float16 --out served-gpu.json
    python benchmarks/bench_served.py --model /tmp/llava-1.5-7b --device cuda \\
        --after-args=--async-scheduling --before-args=--no-async-scheduling \\
        --out served-gpu-async.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from epd_engine.bench.results_file import git_commit, write_results
from epd_engine.local.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


SERVED_NAME = "bench"


class Server:
    """``epdctl serve`` of one tree in a child process (the newest tree when ``path`` is
    None), sized so that the largest batch decodes in one step."""

    def __init__(
        self, args: argparse.Namespace, max_batch: int, path: Path | None, extra: str = ""
    ) -> None:
        model, threads = args.model, args.threads
        self.port = free_port()
        env = dict(os.environ)
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(path / "engine"), env.get("PYTHONPATH", "")])
        command = [sys.executable, *shlex.split(args.server_wrapper or ""), "-m", "epd_engine"]
        command += ["serve", "--model", str(model)]
        command += ["--port", str(self.port), "--log-level", "warning"]
        command += ["--served-model-name", SERVED_NAME, "--device", args.device]
        command += ["--dtype", args.dtype]
        command += ["--token-budget", str(max(8192, max_batch * 256)), "--image-budget", "1"]
        command += ["--max-num-running", str(max_batch), "--num-kv-blocks", str(max_batch * 24)]
        command += shlex.split(extra)
        if threads != 1:
            raise ValueError("the instance runs with its default of one torch thread")
        if args.server_log:
            with open(args.server_log, "ab") as log:  # the child keeps its own descriptor
                self.process = subprocess.Popen(command, env=env, stderr=log)
        else:
            self.process = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self, client: Any) -> None:
        for _ in range(3000):  # a loaded host takes minutes to import torch
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}")
            try:
                if (await client.get(f"{self.url}/health/ready")).status_code == 200:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


async def served_run(
    client: Any, url: str, prompts: list[list[int]], max_tokens: int, stream: bool = False
) -> tuple[float, list[str]]:
    """Seconds for the whole batch, and each request's text."""
    # min_tokens as well as ignore_eos: generate's min_new_tokens masks EOS, while
    # ignore_eos alone lets EOS be drawn (and go on). Without it, rows whose greedy token
    # was EOS differed from generate's (3 of 128 at batch 128 on CPU, each at a clear top-1).
    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def one(prompt: list[int]) -> tuple[int, str]:
        request = {**body, "prompt": prompt}
        if not stream:
            answer = (await client.post(f"{url}/v1/completions", json=request)).json()
            return answer["usage"]["completion_tokens"], answer["choices"][0]["text"]
        # the bytes as they come, parsed after the clock stops: the client's own parsing
        # of every event would share the host's cores with the server's
        async with client.stream("POST", f"{url}/v1/completions", json=request) as response:
            raw = b"".join([chunk async for chunk in response.aiter_bytes()])
        return sse_tokens_and_text(raw)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - start
    if any(count != max_tokens for count, _ in results):
        raise RuntimeError("a request returned fewer tokens than asked")
    return seconds, [text for _, text in results]


def sse_tokens_and_text(raw: bytes) -> tuple[int, str]:
    """Completion tokens (the usage chunk) and the text of a streamed completion."""
    tokens, text = 0, []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        text += [choice["text"] for choice in event.get("choices", [])]
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return tokens, "".join(text)


def hf_run(
    hf: Any, prompts: list[list[int]], max_tokens: int, pad_id: int | None
) -> tuple[float, Any]:
    import torch

    input_ids = torch.tensor(prompts, dtype=torch.long, device=hf.device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          do_sample=False, max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, pad_token_id=pad_id)  # fmt: skip
        if hf.device.type == "cuda":
            torch.cuda.synchronize(hf.device)
        seconds = time.perf_counter() - start
    return seconds, out[:, input_ids.shape[1] :].tolist()


def export_tree(ref: str, into: Path) -> str:
    commit = subprocess.check_output(["git", "rev-parse", ref], cwd=ROOT, text=True).strip()
    archive = subprocess.run(["git", "archive", commit, "engine"], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_step_summary(side: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the rounds: how many decode steps a run took and each phase's mean time in them
    (a tree without ``epd_step_phase_seconds`` gives nothing)."""
    runs = [r[f"{side}_step_phases"]["decode"] for r in rows
            if "decode" in r.get(f"{side}_step_phases", {})]  # fmt: skip
    if not runs:
        return {}
    phases = sorted({phase for run in runs for phase in run["ms"]})
    return {
        f"{side}_decode_steps": spread([run["steps"] for run in runs]),
        f"{side}_decode_step_ms": {
            phase: spread([run["ms"][phase] for run in runs if phase in run["ms"]])
            for phase in phases
        },
    }


async def bench(args: argparse.Namespace, before: Path | None) -> dict[str, Any]:
    import httpx
    import torch
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    from epd_engine.bench.server_metrics import difference, scrape, step_phase_means
    from epd_engine.engine.gc_heap import freeze_startup_heap
    from epd_engine.model.model_config import LlavaModelConfig

    torch.set_num_threads(args.threads)
    config = LlavaModelConfig.from_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    dtype = getattr(torch, args.dtype)
    hf = LlavaForConditionalGeneration.from_pretrained(str(args.model), dtype=dtype)
    hf = hf.to(args.device).eval()
    rng = random.Random(args.seed)
    high = min(config.image_token_index, config.vocab_size) - 1
    batches = args.batches
    prompts = {b: [[rng.randint(3, high) for _ in range(args.context)] for _ in range(b)]
               for b in batches}  # fmt: skip
    # The client shares this process with generate's model: without the freeze a full
    # collection of that heap (160-210 ms) stalled the requests it was sending.
    freeze_startup_heap()
    servers = {"after": Server(args, max(batches), None, args.after_args)}
    if before is not None or args.before_args is not None:
        servers["before"] = Server(args, max(batches), before, args.before_args or "")
    rounds: list[dict[str, Any]] = []
    # Requests whose greedy text equals generate's, per side and batch: on a GPU in 16-bit
    # the two kernels' rounding differs, so a near-tie of random weights can flip a token.
    text_match: dict[str, dict[int, list[int]]] = {side: {} for side in servers}
    # No kept-alive connections: uvicorn drops idle ones after 5 s (a generate round is
    # longer), and a request sent on one as it closes fails with a ReadError.
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=0)
    try:
        async with httpx.AsyncClient(timeout=600, limits=limits) as c:
            for server in servers.values():
                await server.ready(c)
            # Warm-up at every batch size: generate's first call at a new shape was 2-4x
            # slower on a GPU (the first round's ratios of the H200 run of 2026-11-26).
            for batch in batches:
                for server in servers.values():
                    await served_run(c, server.url, prompts[batch], 4, args.stream)
                hf_run(hf, prompts[batch], 4, config.pad_token_id)
            for index in range(args.rounds):
                sides = list(servers)
                if index % 2:
                    sides.reverse()  # neither tree always runs first
                for batch in batches:
                    row: dict[str, Any] = {"round": index, "batch": batch,
                                           "load_average": os.getloadavg()[0]}  # fmt: skip
                    tokens = batch * args.new_tokens
                    seconds, reference = hf_run(hf, prompts[batch], args.new_tokens,
                                                config.pad_token_id)  # fmt: skip
                    row["hf_tokens_per_s"] = tokens / seconds
                    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference]
                    for side in sides:
                        url = servers[side].url
                        metrics_before = scrape(url)  # outside the clock
                        seconds, served = await served_run(
                            c, url, prompts[batch], args.new_tokens, args.stream
                        )
                        phases = step_phase_means(difference(metrics_before, scrape(url)))
                        if phases:  # a tree from before epd_step_phase_seconds has none
                            row[f"{side}_step_phases"] = phases
                        row[f"{side}_tokens_per_s"] = tokens / seconds
                        row[f"{side}_over_hf"] = (
                            row[f"{side}_tokens_per_s"] / row["hf_tokens_per_s"]
                        )
                        same = sum(a == b for a, b in zip(served, texts, strict=True))
                        counts = text_match[side].setdefault(batch, [0, 0])
                        counts[0] += same
                        counts[1] += len(texts)
                    if "before" in servers:
                        row["after_over_before"] = (
                            row["after_tokens_per_s"] / row["before_tokens_per_s"]
                        )
                    rounds.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary: dict[str, Any] = {}
    for batch in batches:
        rows = [r for r in rounds if r["batch"] == batch]
        entry: dict[str, Any] = {}
        for key in rows[0]:
            if key.endswith(("_per_s", "_over_hf", "_over_before")):
                entry[key] = spread([r[key] for r in rows])
        for side in servers:
            same, total = text_match[side][batch]
            entry[f"{side}_greedy_text_matches_hf"] = same == total
            entry[f"{side}_greedy_text_same_share"] = same / total
            entry.update(decode_step_summary(side, rows))
        summary[str(batch)] = entry
    return {"rounds": rounds, "summary": summary}


def summary_table(summary: dict[str, Any]) -> str:
    """Medians per batch and side, as a Markdown table: throughput, ratios, greedy text, and
    the decode steps' phases in ms (the JSON has every round and the spreads)."""
    from epd_engine.engine.step_phases import PHASES as phases

    head = ["batch", "side", "tokens/s", "÷ generate", "÷ before", "greedy same", "decode steps",
            *(f"{p} ms" for p in phases)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for batch, entry in summary.items():
        for side in ("after", "before"):
            if f"{side}_tokens_per_s" not in entry:
                continue
            steps = entry.get(f"{side}_decode_step_ms", {})
            cells = [
                batch,
                side,
                f"{entry[f'{side}_tokens_per_s']['median']:,.0f}",
                f"{entry[f'{side}_over_hf']['median']:.2f}x",
                f"{entry['after_over_before']['median']:.2f}x"
                if side == "after" and "after_over_before" in entry
                else "",
                f"{entry[f'{side}_greedy_text_same_share']:.0%}",
                f"{entry[f'{side}_decode_steps']['median']:.0f}" if steps else "",
                *(f"{steps[p]['median']:.3f}" if p in steps else "" for p in phases),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llava")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=32, help="max_tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--stream", action="store_true", help="stream each answer (server-sent events)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (both sides run there)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="weights' dtype (default: float32 on cpu, float16 on cuda)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", type=Path, help="append the instances' stderr here")
    parser.add_argument(
        "--server-wrapper",
        help="a script the instances run under, before -m: tools/profiling/sample_stacks.py OUT",
    )
    parser.add_argument("--before-ref", help="an earlier commit to A/B against")
    parser.add_argument(
        "--before-path",
        type=Path,
        help="instead of --before-ref, a tree already exported (holding engine/), for a "
        "machine without the repository's history",
    )
    parser.add_argument(
        "--after-args", default="", help="more `epdctl serve` flags for the newest tree's instance"
    )
    parser.add_argument(
        "--before-args",
        help="more flags for the before instance; without --before-ref/--before-path it runs "
        "the newest tree too: --after-args=--async-scheduling "
        "--before-args=--no-async-scheduling A/Bs one flag",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "float16")
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model}: no config.json (epdctl make-model --preset tiny-llava)")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        before_commit = export_tree(args.before_ref, Path(tmp)) if args.before_ref else None
        before = Path(tmp) if args.before_ref else args.before_path
        if args.before_path:
            before_commit = f"{args.before_path} (exported tree)"
        result = asyncio.run(bench(args, before))
    # EPD_TREE_COMMIT names the tree where it travelled without its history (a GPU machine)
    after_commit = git_commit(ROOT)[0] or os.environ.get("EPD_TREE_COMMIT", "unknown (no git)")
    import torch
    import transformers

    report = {
        "benchmark": f"served-{args.device}",
        "command": " ".join(["python", "benchmarks/bench_served.py", *sys.argv[1:]]),
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "trees": {"after": after_commit.strip() + " (+ working tree)", "before": before_commit},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpu_count": os.cpu_count(), "load_average_start": load_start,
                    "load_average_end": os.getloadavg(), "platform": platform.platform()},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "method": __doc__,
        **result,
    }  # fmt: skip
    print(summary_table(report["summary"]))
    if args.out:
        write_results(args.out, report, command=report["command"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
