"""Model families the engine knows: architecture name -> config, modules, checkpoint layout.

A checkpoint's ``config.json`` names its architecture (``architectures[0]``); everything
that differs between families hangs off the ``ModelFamily`` found for it: the config
parser, the vision (E) and language (P/D) modules, where their tensors live in the
checkpoint, and how many LLM tokens an image of a given size becomes. A new family is a
new module plus one entry in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd_engine.contracts.image_grid import smart_resize
from epd_engine.model.gemma3_config import Gemma3ModelConfig
from epd_engine.model.image_bounds import pixel_bounds
from epd_engine.model.model_config import LlavaModelConfig, ModelFormatError, read_json
from epd_engine.model.qwen2_vl_config import Qwen2VLModelConfig
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig

if TYPE_CHECKING:
    from epd_engine.model.mrope import MRopeState

ModelConfig = LlavaModelConfig | Qwen2VLModelConfig | Qwen3VLModelConfig | Gemma3ModelConfig
DynamicResolutionConfig = Qwen2VLModelConfig | Qwen3VLModelConfig  # image_grid_thw families
Skippable = Callable[[str], bool]
RopeRule = Callable[[list[int], Sequence[Any]], "MRopeState"]  # (token ids, ImageRefs) -> state


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a family's tensors live, in the canonical (hub) naming the loader checks against.

    ``aliases``: stored prefix -> canonical prefix, for layouts other writers use (first
    match wins). ``vision_source`` / ``language_source``: our parameter name -> canonical.
    """

    vision_prefixes: tuple[str, ...]
    language_prefixes: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...]
    vision_source: Callable[[str], str]
    language_source: Callable[[Any, str], str]  # (config, param name) -> canonical
    vision_skippable: Callable[[Any], Skippable]  # config -> stored tensors we never load
    language_skippable: Skippable = field(default=lambda name: False)

    def canonical(self, stored: str) -> str:
        for alias, hub in self.aliases:
            if stored.startswith(alias):
                return hub + stored.removeprefix(alias)
        return stored


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]  # config.json "architectures" values we accept
    model_type: str
    config_class: (
        type[LlavaModelConfig]
        | type[Qwen2VLModelConfig]
        | type[Qwen3VLModelConfig]
        | type[Gemma3ModelConfig]
    )
    module: str  # dotted module holding the vision and language classes
    vision_class: str
    language_class: str
    layout: CheckpointLayout
    image_tokens: Callable[[Path, ModelConfig], Callable[[int, int], int]]
    processor: Callable[[Path], Any]  # model dir -> the checkpoint's transformers processor
    presets: tuple[str, ...]
    # Multimodal RoPE: (model dir, config) -> (prompt token ids, image refs) -> MRopeState.
    # None: positions are the KV slots.
    rope: Callable[[Path, Any], RopeRule] | None = None

    def load_config(self, model_dir: Path) -> ModelConfig:
        return self.config_class.from_dir(model_dir)

    def classes(self) -> tuple[type, type]:
        """``(vision, language)`` module classes (imported here: torch only when used)."""
        import importlib

        module = importlib.import_module(self.module)
        return getattr(module, self.vision_class), getattr(module, self.language_class)


# ---- LLaVA-1.5 --------------------------------------------------------------------------
def _llava_vision_source(param_name: str) -> str:
    if param_name.startswith("vision_model."):
        return "vision_tower.vision_model." + param_name.removeprefix("vision_model.").replace(
            "layers.", "encoder.layers.", 1
        )
    return param_name  # multi_modal_projector.*


def _llava_language_source(config: Any, param_name: str) -> str:
    if param_name.startswith("lm_head."):
        return "language_model." + param_name
    return "language_model.model." + param_name


def _llava_vision_skippable(config: Any) -> Skippable:
    import re

    used_layers = config.vision.num_layers_used
    unused = re.compile(
        r"vision_tower\.vision_model\.(post_layernorm\..*|embeddings\.position_ids"
        r"|encoder\.layers\.(\d+)\..*)$"
    )

    def is_skippable(name: str) -> bool:
        # LLaVA never runs the layers after vision_feature_layer, nor the post-LN.
        match = unused.match(name)
        if match is None:
            return False
        return match.group(2) is None or int(match.group(2)) >= used_layers

    return is_skippable


def _llava_image_tokens(model_dir: Path, config: ModelConfig) -> Callable[[int, int], int]:
    assert isinstance(config, LlavaModelConfig)
    tokens = config.num_image_tokens
    return lambda width, height: tokens  # every image is resized to one square


LLAVA = ModelFamily(
    name="llava",
    architectures=("LlavaForConditionalGeneration",),
    model_type="llava",
    config_class=LlavaModelConfig,
    module="epd_engine.model.llava",
    vision_class="LlavaVision",
    language_class="LlavaLanguage",
    layout=CheckpointLayout(
        vision_prefixes=("vision_tower.", "multi_modal_projector."),
        language_prefixes=("language_model.",),
        aliases=(  # newer transformers layout -> hub layout
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("lm_head.", "language_model.lm_head."),
        ),
        vision_source=_llava_vision_source,
        language_source=_llava_language_source,
        vision_skippable=_llava_vision_skippable,
        language_skippable=lambda name: name.endswith("rotary_emb.inv_freq"),
    ),
    image_tokens=_llava_image_tokens,
    processor=lambda model_dir: _auto_processor(model_dir),
    presets=("tiny-llava", "llava-1.5-7b"),
)


# ---- Qwen2-VL ---------------------------------------------------------------------------
def _qwen2_vl_language_source(config: Any, param_name: str) -> str:
    if param_name.startswith("lm_head."):
        return "model.embed_tokens.weight" if config.tie_word_embeddings else param_name
    return "model." + param_name


def qwen2_vl_image_grid(
    model_dir: Path, config: DynamicResolutionConfig
) -> Callable[[int, int], tuple[int, int, int]]:
    """``(t, h, w)`` patches of a ``width x height`` image under the checkpoint's image
    processor bounds (its ``image_grid_thw``)."""
    bounds = pixel_bounds(model_dir, config)  # the deployment's max_pixels applied

    def grid(width: int, height: int) -> tuple[int, int, int]:
        h, w = smart_resize(height, width, bounds.factor, bounds.min_pixels, bounds.max_pixels)
        return 1, h // bounds.patch, w // bounds.patch

    return grid


def _qwen2_vl_image_tokens(model_dir: Path, config: ModelConfig) -> Callable[[int, int], int]:
    """Tokens of a ``width x height`` image: its patches over ``merge ** 2``."""
    assert isinstance(config, Qwen2VLModelConfig | Qwen3VLModelConfig)
    grid = qwen2_vl_image_grid(model_dir, config)

    def tokens(width: int, height: int) -> int:
        t, h, w = grid(width, height)
        return t * h * w // config.merge_unit

    return tokens


def _qwen2_vl_rope(model_dir: Path, config: DynamicResolutionConfig) -> RopeRule:
    """A request's M-RoPE state from its prompt: each image's grid follows from its size
    (the processor's rule), so any instance recomputes it from the request alone."""
    grid_of = qwen2_vl_image_grid(model_dir, config)

    def state(token_ids: list[int], images: Sequence[Any]) -> MRopeState:
        from epd_engine.model.mrope import MRopeState, mrope_positions  # torch: when used

        grids = [grid_of(image.width, image.height) for image in images]
        for image, (t, h, w) in zip(images, grids, strict=True):
            if t * h * w // config.merge_unit != image.num_tokens:
                raise ValueError(
                    f"image {image.width}x{image.height} has {image.num_tokens} tokens, "
                    f"its grid {t}x{h}x{w} gives {t * h * w // config.merge_unit}"
                )
        positions, delta = mrope_positions(
            token_ids, grids, config.image_token_index, config.vision.spatial_merge_size
        )
        return MRopeState(positions, delta)

    return state


QWEN2_VL = ModelFamily(
    name="qwen2-vl",
    architectures=("Qwen2VLForConditionalGeneration",),
    model_type="qwen2_vl",
    config_class=Qwen2VLModelConfig,
    module="epd_engine.model.qwen2_vl",
    vision_class="Qwen2VLVision",
    language_class="Qwen2VLLanguage",
    layout=CheckpointLayout(
        vision_prefixes=("visual.",),
        language_prefixes=("model.", "lm_head."),
        aliases=(  # transformers >= 4.52 save_pretrained layout -> hub layout
            ("model.visual.", "visual."),
            ("model.language_model.", "model."),
        ),
        vision_source=lambda name: "visual." + name,
        language_source=_qwen2_vl_language_source,
        vision_skippable=lambda config: lambda name: False,
        language_skippable=lambda name: name.endswith("rotary_emb.inv_freq"),
    ),
    image_tokens=_qwen2_vl_image_tokens,
    processor=lambda model_dir: _qwen2_vl_processor(model_dir),
    rope=lambda model_dir, config: _qwen2_vl_rope(model_dir, config),
    presets=("tiny-qwen2-vl", "tiny-qwen2-vl-12mp", "qwen2-vl-7b"),
)

# Qwen2.5-VL: the same modules (windowed ViT blocks, from its config), layout and rules.
QWEN2_5_VL = replace(
    QWEN2_VL,
    name="qwen2.5-vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    model_type="qwen2_5_vl",
    presets=("tiny-qwen2.5-vl", "qwen2.5-vl-7b"),
)


# ---- Qwen3-VL ---------------------------------------------------------------------------
def _qwen3_vl_language_source(config: Any, param_name: str) -> str:
    if param_name.startswith("lm_head."):
        if config.tie_word_embeddings:
            return "model.language_model.embed_tokens.weight"
        return param_name
    return "model.language_model." + param_name


# Qwen3-VL: its own modules (DeepStack, q/k norms, interleaved M-RoPE); Qwen2-VL's image
# rules (the same processor rule with 16-px patches, the same M-RoPE positions).
QWEN3_VL = ModelFamily(
    name="qwen3-vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    model_type="qwen3_vl",
    config_class=Qwen3VLModelConfig,
    module="epd_engine.model.qwen3_vl",
    vision_class="Qwen3VLVision",
    language_class="Qwen3VLLanguage",
    layout=CheckpointLayout(  # the release's names are transformers 4.57's: no aliases
        vision_prefixes=("model.visual.",),
        language_prefixes=("model.language_model.", "lm_head."),
        aliases=(),
        vision_source=lambda name: "model.visual." + name,
        language_source=_qwen3_vl_language_source,
        vision_skippable=lambda config: lambda name: False,
    ),
    image_tokens=_qwen2_vl_image_tokens,
    processor=lambda model_dir: _qwen3_vl_processor(model_dir),
    rope=lambda model_dir, config: _qwen2_vl_rope(model_dir, config),
    presets=("tiny-qwen3-vl", "qwen3-vl-8b"),
)


# ---- Gemma 3 ----------------------------------------------------------------------------
def _gemma3_language_source(config: Any, param_name: str) -> str:
    if param_name.startswith("lm_head."):
        if config.tie_word_embeddings:
            return "language_model.model.embed_tokens.weight"
        return "language_model." + param_name
    return "language_model.model." + param_name


def _gemma3_image_tokens(model_dir: Path, config: ModelConfig) -> Callable[[int, int], int]:
    assert isinstance(config, Gemma3ModelConfig)
    tokens = config.num_image_tokens
    return lambda width, height: tokens  # every image is resized to one square


GEMMA3 = ModelFamily(
    name="gemma3",
    architectures=("Gemma3ForConditionalGeneration",),
    model_type="gemma3",
    config_class=Gemma3ModelConfig,
    module="epd_engine.model.gemma3",
    vision_class="Gemma3Vision",
    language_class="Gemma3Language",
    layout=CheckpointLayout(  # the release's names; transformers 4.57 saves the aliases
        vision_prefixes=("vision_tower.", "multi_modal_projector."),
        language_prefixes=("language_model.",),
        aliases=(
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("lm_head.", "language_model.lm_head."),
        ),
        vision_source=_llava_vision_source,  # SigLIP's names sit where CLIP's do
        language_source=_gemma3_language_source,
        # a SigLIP head (vision_use_head) Gemma 3 never runs; a saved copy of the tied head
        vision_skippable=lambda config: (
            lambda name: name.startswith("vision_tower.vision_model.head.")
        ),
        language_skippable=lambda name: name == "language_model.lm_head.weight",
    ),
    image_tokens=_gemma3_image_tokens,
    processor=lambda model_dir: _gemma3_processor(model_dir),
    presets=("tiny-gemma3", "gemma3-4b"),
)

FAMILIES: tuple[ModelFamily, ...] = (LLAVA, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, GEMMA3)


def _auto_processor(model_dir: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def _qwen2_vl_processor(model_dir: Path) -> Any:
    from epd_engine.model.qwen2_vl_processor import load_qwen2_vl_processor

    return load_qwen2_vl_processor(model_dir)


def _qwen3_vl_processor(model_dir: Path) -> Any:
    from epd_engine.model.qwen3_vl_processor import load_qwen3_vl_processor

    return load_qwen3_vl_processor(model_dir)


def _gemma3_processor(model_dir: Path) -> Any:
    from epd_engine.model.gemma3_processor import load_gemma3_processor

    return load_gemma3_processor(model_dir)


def supported_architectures() -> list[str]:
    return [arch for family in FAMILIES for arch in family.architectures]


def family_for(raw: dict[str, Any], source: str = "config.json") -> ModelFamily:
    """The family of a parsed ``config.json``: by ``architectures``, else by ``model_type``."""
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if any(arch in family.architectures for arch in architectures):
            return family
    if not architectures:
        for family in FAMILIES:
            if raw.get("model_type") == family.model_type:
                return family
    named = ", ".join(architectures) or f"model_type {raw.get('model_type')!r}"
    raise ModelFormatError(
        f"{source}: unsupported architecture {named}; supported: "
        + ", ".join(supported_architectures())
    )


def family_of(model_dir: Path) -> ModelFamily:
    """The family of the checkpoint in ``model_dir`` (reads its ``config.json``)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{config_path} not found: not a Hugging Face model directory")
    return family_for(read_json(config_path), str(config_path))


def load_model_config(model_dir: Path) -> ModelConfig:
    return family_of(model_dir).load_config(Path(model_dir))


def family_of_preset(preset: str) -> ModelFamily:
    for family in FAMILIES:
        if preset in family.presets:
            return family
    names = [p for family in FAMILIES for p in family.presets]
    raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(names)}")
