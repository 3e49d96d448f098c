"""``epdctl make-model``: write a random-weight checkpoint in Hugging Face hub layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from epd_engine.cli import UserError

# Mirrors epd_engine.model.make_model.ALL_PRESETS (no torch here); a test keeps them equal.
PRESET_NAMES = (
    "tiny-llava",
    "llava-1.5-7b",
    "tiny-qwen2-vl",
    "tiny-qwen2-vl-12mp",
    "qwen2-vl-7b",
    "tiny-qwen2.5-vl",
    "qwen2.5-vl-7b",
    "tiny-qwen3-vl",
    "qwen3-vl-8b",
    "tiny-gemma3",
    "gemma3-4b",
)
DTYPES = ("float32", "float16", "bfloat16")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight checkpoint (config, safetensors, tokenizer, processor)",
        description=(
            "Write a random-weight checkpoint in hub layout (LLaVA-1.5: llava-hf/llava-1.5-7b-hf; "
            "Qwen2-VL: Qwen/Qwen2-VL-7B-Instruct; Qwen2.5-VL: Qwen/Qwen2.5-VL-7B-Instruct; "
            "Qwen3-VL: Qwen/Qwen3-VL-8B-Instruct; Gemma 3: google/gemma-3-4b-it), "
            "loadable by the engine and by transformers. "
            "No download."
        ),
    )
    parser.add_argument("out_dir", metavar="DIR", type=Path, help="output directory")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="tiny-llava")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="weight dtype (default: the preset's)"
    )
    parser.add_argument(
        "--force", action="store_true", help="write into DIR even if it already holds a model"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out_dir: Path = args.out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    if (out_dir / "config.json").exists() and not args.force:
        raise UserError(f"{out_dir} already holds a model (config.json); pass --force to overwrite")
    from epd_engine.model.make_model import make_model  # torch: imported only when used

    try:
        make_model(args.preset, out_dir, seed=args.seed, dtype=args.dtype)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    print(f"wrote {args.preset} to {out_dir}")
    return 0
