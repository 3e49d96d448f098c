"""``epdctl serve``: run one engine instance (any role) with the OpenAI API on HTTP."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from epd_engine.api.keep_alive import IDLE_KEEP_ALIVE_S
from epd_engine.api.log_setup import setup_logging
from epd_engine.cli import UserError
from epd_engine.config import (
    ATTENTION_BACKENDS,
    SLO,
    TENSOR_PARALLEL_SIZES,
    EngineConfig,
    Role,
    fault_injection_spec,
    internal_token_set,
)
from epd_engine.transfer import AVAILABLE_TRANSFER_BACKENDS, TRANSFER_BACKENDS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model as one engine instance")
    p.add_argument(
        "--model",
        type=Path,
        help="checkpoint directory (HF layout); with --emulate, only the name to serve under "
        "(default: the cost model's), which gets the suffix -emulated",
    )
    p.add_argument(
        "--emulate",
        metavar="COST_MODEL",
        help="run an emulated instance: the real scheduler, budgets and page accounting, step "
        "times from this cost-model JSON (epdctl profile-costs) or 'reference[:MODEL]' (a "
        "built-in synthetic one), deterministic tokens; no torch, no weights, and no evidence "
        "of engine speed",
    )
    p.add_argument(
        "--preset",
        help="make a random-weight checkpoint of this preset at --model first if it is missing",
    )
    p.add_argument("--role", default="EPD", choices=[r.value for r in Role])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="name clients use (default: the directory name)")
    p.add_argument("--pool", default="local", help="pool name (metrics label, router registration)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: FlashInfer on CUDA when it is installed and fits the model, else torch SDPA",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run decode steps eagerly (graphs are only used on CUDA with FlashInfer)",
    )
    p.add_argument(
        "--preprocess-workers",
        type=int,
        default=0,
        help="decode images and run the processor (chat template, tokenizer) in this many "
        "worker processes, so a request's preprocessing does not stall the engine's steps "
        "(one GIL); 0 (default): in a thread of the instance's process",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch step N+1 while step N runs on the GPU, its tokens read back "
        "after (default: on with a CUDA device, off on a CPU, where a step runs on the host)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache pages (default: 512 on CPU, more for a prompt of the largest image; "
        "on CUDA, what --gpu-memory-fraction of the GPU leaves once the weights, the image "
        "cache and the largest step's activations are counted)",
    )
    p.add_argument(
        "--no-dual-stream",
        dest="dual_stream",
        action="store_false",
        help="on CUDA, run encodes before the language-model step instead of beside it",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="share of its GPU this instance may use for weights and caches (epdctl up "
        "splits it between instances placed on one GPU)",
    )
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="do not keep KV pages for later requests with the same prefix (on by default)",
    )
    p.add_argument(
        "--num-image-blocks",
        type=int,
        default=64,
        help="image-cache pages (raised to hold the model's largest image)",
    )
    p.add_argument(
        "--processor-max-pixels",
        type=int,
        help="resize images to at most this many pixels (Qwen-VL: lowers the checkpoint "
        "processor's max_pixels, as vLLM's mm_processor_kwargs; default: the checkpoint's)",
    )
    p.add_argument(
        "--token-budget", type=int, help="tokens per iteration (default: searched against the SLO)"
    )
    p.add_argument(
        "--image-budget",
        type=int,
        help="images per iteration, each counted as one image-cache page of tokens (LLaVA-1.5: "
        "576); default: searched against the SLO",
    )
    p.add_argument(
        "--image-token-budget",
        type=int,
        help="image tokens encoded per iteration (instead of --image-budget)",
    )
    p.add_argument("--max-num-running", type=int, default=256)
    p.add_argument("--max-images-per-request", type=int, default=8)
    p.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    p.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024, help="body (413)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="per image")
    p.add_argument(
        "--max-request-pixels", type=int, default=2 * 4096 * 4096, help="all images of a request"
    )
    p.add_argument("--max-prompt-tokens", type=int, help="default: the context window less one")
    p.add_argument(
        "--allow-image-host",
        action="append",
        default=[],
        help="fetch http(s) image URLs from this host (repeat; '*' any public host); "
        "private, loopback and link-local addresses are refused whatever the name",
    )
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=120.0,
        help="out of service (probes fail, the router stops routing here) when the engine "
        "thread makes no progress this long while it has work: a hung device; 0: never",
    )
    add_tensor_parallel_size(
        p,
        "split the language model over this many ranks, one device each (rank r on the "
        "instance's GPU + r; on a CPU, processes sharing it); every role but E",
    )
    p.add_argument(
        "--rank-timeout-s",
        type=float,
        default=120.0,
        help="tensor parallel: how long a rank waits for a hung peer in a collective",
    )
    p.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, default=0.08, help="TPOT SLO in seconds")
    p.add_argument(
        "--router-url",
        action="append",
        help="register with this router and serve the requests it routes; several replicas: "
        "repeat it or give a comma list (each replica gets its own requests' events)",
    )
    p.add_argument(
        "--router-dns",
        action="store_true",
        help="each --router-url's host names every router replica (a headless Service): "
        "resolve it every 2 s and register with each address",
    )
    p.add_argument(
        "--advertise-url",
        help="URL the router and peers use to reach this instance (default: http://HOST:PORT)",
    )
    p.add_argument("--instance-id", help="stable instance name (default: the advertise URL)")
    p.add_argument(
        "--transfer-backend",
        default="auto",
        choices=TRANSFER_BACKENDS,
        help="cache migration backend: auto (CPU: shm with same-host peers, else tcp; CUDA: "
        "cuda_ipc with peers whose GPU this process sees, else nixl, tcp without NIXL), tcp, "
        "shm, collective (gloo), nixl (NIXL over UCX: RDMA, CUDA IPC or TCP; CPU or CUDA), "
        "cuda_ipc (CUDA IPC handles, same node), nccl (CuPy NCCL); cuda_ipc and nccl need "
        "--device cuda (nccl also CuPy)",
    )
    p.add_argument(
        "--transfer-port",
        type=int,
        default=0,
        help="port of the tcp page server (default: any free port; peers learn it per offer)",
    )
    p.add_argument(
        "--kv-layers-per-group",
        type=int,
        default=8,
        help="KV migrates in groups of this many layers (each moves once it is written)",
    )
    p.add_argument(
        "--kv-handoff",
        choices=("early", "after-prefill"),
        default="early",
        help="early: offer a request to its decode instance when prefill starts and move "
        "its KV layer group by layer group while prefill runs; after-prefill: offer it "
        "once prefill has ended",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds a SIGTERM waits for in-flight requests (no new ones come) before the "
        "rest are handed back to the router and the instance exits; a second SIGTERM or "
        "SIGINT exits at once",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def add_tensor_parallel_size(parser: argparse.ArgumentParser, help: str) -> None:
    """``--tensor-parallel-size``, as ``serve`` and ``profile-costs`` take it."""
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, choices=TENSOR_PARALLEL_SIZES, help=help
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(
            model_dir=args.model,
            role=Role(args.role),
            served_model_name=args.served_model_name,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            cuda_graphs=args.cuda_graphs,
            async_scheduling=args.async_scheduling,
            preprocess_workers=args.preprocess_workers,
            kv_block_size=args.kv_block_size,
            prefix_cache=args.prefix_cache,
            num_kv_blocks=args.num_kv_blocks,
            gpu_memory_fraction=args.gpu_memory_fraction,
            dual_stream=args.dual_stream,
            num_image_blocks=args.num_image_blocks,
            processor_max_pixels=args.processor_max_pixels,
            token_budget=args.token_budget,
            image_budget=args.image_budget,
            image_token_budget=args.image_token_budget,
            max_num_running=args.max_num_running,
            max_images_per_request=args.max_images_per_request,
            max_image_bytes=args.max_image_bytes,
            max_model_len=args.max_model_len,
            max_request_bytes=args.max_request_bytes,
            max_image_pixels=args.max_image_pixels,
            max_request_pixels=args.max_request_pixels,
            max_prompt_tokens=args.max_prompt_tokens,
            remote_image_hosts=tuple(args.allow_image_host),
            slo=SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot),
            stall_timeout_s=args.stall_timeout_s,
            tensor_parallel_size=args.tensor_parallel_size,
            rank_timeout_s=args.rank_timeout_s,
            fault_injection=fault_injection_spec(),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc


GIL_SWITCH_INTERVAL_S = 0.0005
STARTUP_FAILURE_EXIT = 3  # uvicorn's, when the app did not start


def run(args: argparse.Namespace) -> int:
    if args.emulate is not None:
        from epd_engine.emulate.serve import run_emulated

        return run_emulated(args)
    if args.model is None:
        raise UserError("--model is required (a checkpoint directory), unless --emulate")
    import uvicorn

    from epd_engine.api.draining import DrainingServer
    from epd_engine.engine import startup
    from epd_engine.model.hub_cache import resolve_snapshot
    from epd_engine.server.app import ServerSettings, create_app
    from epd_engine.server.drain import drain
    from epd_engine.transfer.factory import check_backend

    startup.mark("imports")

    # The engine thread holds the GIL through the Python parts of every step; the event loop
    # (pulls, token events, heartbeats) must not wait the default 5 ms for it each time.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    setup_logging(args.log_level)
    if args.transfer_backend not in AVAILABLE_TRANSFER_BACKENDS:
        raise UserError(
            f"transfer backend {args.transfer_backend!r} is not available in this build; "
            f"use one of {', '.join(AVAILABLE_TRANSFER_BACKENDS)}"
        )
    try:
        check_backend(args.transfer_backend, args.device)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    args.model = resolve_snapshot(args.model)  # a hub cache's snapshots/<branch or tag>
    if args.preset and not (args.model / "config.json").exists():
        from epd_engine.model.make_model import make_model

        make_model(args.preset, args.model)
    if not (args.model / "config.json").exists():
        raise UserError(f"{args.model} has no config.json; make one with `epdctl make-model`")
    if args.router_url and not internal_token_set():
        raise UserError(
            "--router-url needs the deployment's secret in EPD_INTERNAL_TOKEN (the same as the "
            "router's); `epdctl up` and the operator set it"
        )
    advertise = args.advertise_url or f"http://{args.host}:{args.port}"
    settings = ServerSettings(
        engine=engine_config(args),
        pool=args.pool,
        router_url=",".join(args.router_url) if args.router_url else None,
        resolve_router_replicas=args.router_dns,
        advertise_url=advertise,
        instance_id=args.instance_id or "",
        bind_host=args.host,
        transfer_backend=args.transfer_backend,
        transfer_port=args.transfer_port,
        kv_layers_per_group=args.kv_layers_per_group,
        early_kv=args.kv_handoff == "early",
    )
    app = create_app(settings, freeze_heap=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=IDLE_KEEP_ALIVE_S,
    )
    server = DrainingServer(
        config, lambda: drain(getattr(app.state, "instance", None), args.drain_timeout)
    )
    server.run()
    if not server.started:  # as uvicorn.run: the app did not start (its lifespan failed)
        sys.exit(STARTUP_FAILURE_EXIT)
    return 0
