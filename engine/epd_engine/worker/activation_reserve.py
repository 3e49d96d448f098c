"""Memory the largest step's transient tensors take, from the model's shapes (issue 31).

A GPU instance plans its KV pages as its share of the card less the weights, the image
cache and a reserve for the activations of its largest step; the start-up budget search
must then never run a step larger than that reserve covers. Both used to be constants sized
for LLaVA-7B (a 2 GiB reserve, prefill probes up to the whole context): a Qwen2.5-VL-7B
prefill of 32k tokens holds about 9 GiB of MLP activations alone, and a 12.8 MP image's
65k patches about 2.5 GiB in its vision tower.

The estimate counts, per token of a prefill (per patch of an encode), the tensors alive at
a layer's peak: the residual stream and its norm, q/k/v, the attention output and the MLP's
gate, up and product (attention itself is FlashInfer / SDPA: no score matrix). ``SLACK``
covers what it does not count (the allocator's rounding, kernel workspaces, the float32
copies some ops make); docs/gpu.md compares it with peaks measured on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Counted tensors x SLACK against the peak measured on an H200 (Qwen2-VL-7B, bf16): 1.7x an
# 8,192-token prefill's peak, 2.6x a 12.8 MP photo's (docs/gpu.md); kept at 2 until more
# shapes are measured.
SLACK = 2.0
WORKSPACE_BYTES = 256 << 20  # attention / GEMM workspaces, whatever the step's size
# the largest reserve an instance sets aside: past this, KV pages are worth more than
# probing (and then running) longer prefill steps
MAX_RESERVE_SHARE = 0.1
MIN_PROBE_TOKENS = 256  # never plan a token budget search smaller than this


@dataclass(frozen=True)
class StepShapes:
    """What a step's activations scale with. Vision fields are 0 for a role without one."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vision_width: int = 0
    vision_mlp_width: int = 0
    vision_patch_dim: int = 0  # values per input patch
    patches_per_token: int = 1  # patches merged into one LLM token (Qwen: merge^2)

    @classmethod
    def of(cls, config: Any) -> StepShapes:
        """From any family's parsed config."""
        vision = config.vision
        width = getattr(vision, "embed_dim", None) or vision.hidden_size
        mlp = getattr(vision, "mlp_hidden_dim", None) or vision.intermediate_size
        patch_dim = getattr(vision, "patch_dim", None) or vision.num_channels * vision.patch_size**2
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            vision_width=width,
            vision_mlp_width=mlp,
            vision_patch_dim=patch_dim,
            patches_per_token=getattr(config, "merge_unit", 1),
        )

    def prefill_bytes_per_token(self, element: int) -> int:
        attention = (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim  # q k v, out
        values = 2 * self.hidden_size + attention + 3 * self.intermediate_size
        return int(values * element * SLACK)

    def encode_bytes_per_patch(self, element: int) -> int:
        # q and k get their rotary in float32: 2 widths at 4 bytes beside the step's dtype
        values = self.vision_patch_dim + 6 * self.vision_width + 3 * self.vision_mlp_width
        return int((values * element + 2 * self.vision_width * 4) * SLACK)


@dataclass(frozen=True)
class ActivationPlan:
    reserve_bytes: int  # set aside before the KV pages
    max_prefill_tokens: int  # the budget search's largest probe (0: this role prefills nothing)


def plan_activations(
    shapes: StepShapes,
    element: int,
    share_bytes: int,  # this instance's share of the card less its weights and caches
    max_step_tokens: int,  # the most a prefill step could hold (context window less one)
    largest_image_tokens: int,
    prefills: bool,
    encodes: bool,
) -> ActivationPlan:
    """The reserve for the largest step and the longest prefill worth probing: a prefill up
    to ``max_step_tokens`` where that fits ``MAX_RESERVE_SHARE`` of the share, else the most
    that does; plus an encode of the largest image (a smaller reserve would fail on it)."""
    encode = 0
    if encodes:
        patches = largest_image_tokens * shapes.patches_per_token
        encode = patches * shapes.encode_bytes_per_patch(element)
    probe = 0
    prefill = 0
    if prefills:
        per_token = shapes.prefill_bytes_per_token(element)
        affordable = int(share_bytes * MAX_RESERVE_SHARE) // per_token
        probe = max(min(max_step_tokens, affordable), min(MIN_PROBE_TOKENS, max_step_tokens))
        prefill = probe * per_token
    # an encode may run beside a prefill (its own stream): both are alive at once
    return ActivationPlan(WORKSPACE_BYTES + encode + prefill, probe)
