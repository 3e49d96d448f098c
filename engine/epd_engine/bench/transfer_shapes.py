"""What ``bench-transfer`` moves: one request's KV cache and one image's embeddings, in a
model's real cache geometry, and the transfers the engine would issue for them.

The caches hold exactly the request's pages (``CacheSpec``); the transfers come from
``transfer.plan.transfers_for``, as a migration target builds them: the image in one
transfer, the KV in layer groups of ``layers_per_group`` layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epd_engine.bench.transfer_peer import CacheSpec
from epd_engine.cache.kv_cache import blocks_needed
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.model.presets import LLAVA_15_7B, TINY_LLAVA
from epd_engine.model.registry import ModelConfig, load_model_config
from epd_engine.request import CacheKind, PullSpec
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.backend import PageTransfer
from epd_engine.transfer.memory import dtype_of
from epd_engine.transfer.plan import transfers_for

REQUEST_ID = "bench"
DEFAULT_TOKENS = 640  # a typical LLaVA-1.5 request: one image (576) plus its text


@dataclass(frozen=True)
class TransferShape:
    name: str
    spec: CacheSpec
    num_tokens: int  # KV tokens of the request
    layers_per_group: int = 8

    @property
    def num_kv_pages(self) -> int:
        return blocks_needed(self.num_tokens, self.spec.block_size)

    def kv_transfers(self) -> list[PageTransfer]:
        pages = tuple(range(self.num_kv_pages))
        source = PullSpec(CacheKind.KV, "", "", kv_pages=pages)
        task = PullTask(REQUEST_ID, CacheKind.KV, source, kv_blocks=list(pages),
                        num_kv_tokens=self.num_tokens)  # fmt: skip
        return transfers_for(task, self.spec.num_layers, self.layers_per_group,
                             self.spec.block_size)  # fmt: skip

    def image_transfers(self) -> list[PageTransfer]:
        source = PullSpec(CacheKind.IMAGE, "", "", image_pages=((0,),))
        task = PullTask(REQUEST_ID, CacheKind.IMAGE, source, image_blocks={0: [0]})
        return transfers_for(task, self.spec.num_layers, self.layers_per_group,
                             self.spec.block_size)  # fmt: skip

    def page_transfers(self) -> list[PageTransfer]:
        """The smallest transfer: one KV page of one layer (the per-transfer overhead)."""
        return [PageTransfer(REQUEST_ID, CacheKind.KV, (0,), (0,), 0, 1)]

    def nbytes(self, transfer: PageTransfer) -> int:
        """Bytes one transfer moves."""
        spec = self.spec
        if transfer.kind is CacheKind.IMAGE:
            per_page = spec.image_tokens * spec.hidden
        else:
            per_page = 2 * spec.block_size * spec.kv_heads * spec.head_dim
            per_page *= transfer.layer_stop - transfer.layer_start
        return per_page * len(transfer.src_pages) * self.element_size

    @property
    def element_size(self) -> int:
        return dtype_of(self.spec.dtype).itemsize


def shape_of(
    name: str,
    model: ModelConfig,
    dtype: str,
    num_tokens: int = DEFAULT_TOKENS,
    layers_per_group: int = 8,
    block_size: int = 16,
) -> TransferShape:
    """The cache an engine serving ``model`` holds for one request of ``num_tokens``."""
    spec = CacheSpec(
        num_layers=model.num_layers,
        num_kv_pages=blocks_needed(num_tokens, block_size),
        block_size=block_size,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        num_image_pages=1,
        image_tokens=model.image_page_tokens,
        hidden=model.image_row_size,  # Qwen3-VL: the DeepStack levels ride in the row
        dtype=dtype,
    )
    return TransferShape(name, spec, num_tokens, layers_per_group)


def tiny_shape(
    model_dir: Path | None, num_tokens: int = DEFAULT_TOKENS, layers_per_group: int = 8
) -> TransferShape:
    """The tiny checkpoint's geometry (its config.json; the preset's when there is none)."""
    if model_dir is not None and (model_dir / "config.json").is_file():
        model: ModelConfig = load_model_config(model_dir)
    else:
        model = LlavaModelConfig.from_dict(TINY_LLAVA.hf_config(TINY_LLAVA.default_dtype))
    return shape_of("tiny", model, model.torch_dtype or "float32", num_tokens, layers_per_group)


def llava_7b_shape(num_tokens: int = DEFAULT_TOKENS, layers_per_group: int = 8) -> TransferShape:
    """LLaVA-1.5-7B in fp16: 32 layers x 32 KV heads x 128; 640 tokens are 335 MB of KV."""
    model = LlavaModelConfig.from_dict(LLAVA_15_7B.hf_config("float16"))
    return shape_of("llava-1.5-7b", model, "float16", num_tokens, layers_per_group)
