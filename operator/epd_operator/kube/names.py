"""Names, labels and ports every rendered child of an EPDDeployment shares."""

from __future__ import annotations

from epd_operator.rollout.pool_identity import Owner, base_name

ENGINE_PORT = 8000
MODELS_DIR = "/models"
LABEL_DEPLOYMENT = "epd.serving.dev/deployment"
LABEL_POOL = "epd.serving.dev/pool"
LABEL_ROLE = "epd.serving.dev/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
# On a pool's Deployment: GPUs each of its pods holds, whatever the resource's name (roles may
# request different ones, engine.roles.<role>.gpuResourceName).
ANNOTATION_GPUS = "epd.serving.dev/gpus-per-instance"


def config_name(owner: Owner) -> str:
    return f"{base_name(owner)}-config"


def secret_name(owner: Owner) -> str:
    return f"{base_name(owner)}-internal-token"


def label_value(name: str) -> str:
    """An object name as a label value (at most 63 characters)."""
    return name[:63]


def labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "epd",
        "app.kubernetes.io/instance": label_value(owner.name),
        "app.kubernetes.io/managed-by": "epd-operator",
        LABEL_COMPONENT: component,
        LABEL_DEPLOYMENT: label_value(owner.name),
    }
