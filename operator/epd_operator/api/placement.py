"""``spec.placement``: whether the instances that exchange caches run in one pod.

``Pools`` (the default): one Deployment per pool; pools that hand caches to each other prefer
one node (``kube/partner_affinity.py``), and caches cross pods over the network.

``Groups``: each slice of the plan, one instance of every pool (an E, a P and a D under E+P+D;
an EP and a D under EP+D), runs as one pod (``epdctl group``), on one node, with every GPU of
the pod visible to each member, so ``auto`` moves caches inside the slice through ``cuda_ipc``
(``shm`` on CPU). A pod has one image, one GPU resource, one node selector and one set of
tolerations, so roles may not set their own; and the members' backend must be ``auto``, the
one that picks the in-pod path for a partner in the pod and the network for the others.

The rules are CEL rules of the spec (``GROUP_RULES``) and ``check_groups`` says the same, so
the API server and ``epdctl up`` give one answer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from epd_engine.config import Method, Role
from epd_operator.api.model_base import SpecModel, cel
from epd_operator.api.pod_settings import RoleSettingsByRole

# What a role may not set under Groups: the pod of a slice has only one of each.
POD_WIDE_ROLE_FIELDS = ("image", "gpuResourceName", "nodeSelector", "tolerations")


class PlacementSpec(SpecModel):
    mode: Literal["Pools", "Groups"] = Field(
        default="Pools",
        description="Pools: a Deployment per pool, cache partners prefer one node. Groups: "
        "one pod per slice of the plan (one instance of every pool), whose members move "
        "caches inside the pod (cuda_ipc on GPUs, shm on CPU); a pool's instances beyond "
        "the smallest pool's count stay in its own Deployment. Plans of one pool (EPD) "
        "are not grouped.",
    )

    @property
    def grouped(self) -> bool:
        return self.mode == "Groups"


_GROUPS = "has(self.placement) && self.placement.mode == 'Groups'"
_ROLE_SET = " && ".join(
    f"(!has(self.engine.roles.{role.value}) || "
    + " && ".join(f"!has(self.engine.roles.{role.value}.{n})" for n in POD_WIDE_ROLE_FIELDS)
    + ")"
    for role in Role
)

GROUP_RULES = [
    cel(
        f"!({_GROUPS}) || !has(self.disaggregation.method) || self.disaggregation.method != 'EPD'",
        "placement.mode Groups puts one instance of every pool in a pod: method EPD has one "
        "pool, nothing to group",
        ".placement.mode",
    ),
    cel(
        f"!({_GROUPS}) || !has(self.engine.transferBackend) || "
        "self.engine.transferBackend == 'auto'",
        "placement.mode Groups needs engine.transferBackend auto (cuda_ipc or shm inside a "
        "group, the network to other pods)",
        ".engine.transferBackend",
    ),
    cel(
        f"!({_GROUPS}) || !has(self.engine.roles) || ({_ROLE_SET})",
        "placement.mode Groups runs a slice's roles in one pod: set image, gpuResourceName, "
        "nodeSelector and tolerations on engine, not on engine.roles.<role>",
        ".engine.roles",
    ),
]


def check_groups(
    placement: PlacementSpec,
    method: Method | None,
    transfer_backend: str,
    roles: RoleSettingsByRole,
) -> None:
    """``GROUP_RULES`` in Python; ValueError naming the field."""
    if not placement.grouped:
        return
    if method == Method.EPD:
        raise ValueError(
            "placement.mode Groups puts one instance of every pool in a pod: method EPD has "
            "one pool, nothing to group"
        )
    if transfer_backend != "auto":
        raise ValueError(
            f"placement.mode Groups needs engine.transferBackend auto, not {transfer_backend} "
            "(cuda_ipc or shm inside a group, the network to other pods)"
        )
    for role in Role:
        own = roles.get(role)
        if own is None:
            continue
        set_here = sorted(own.model_dump(by_alias=True, exclude_none=True).keys())
        pod_wide = [name for name in POD_WIDE_ROLE_FIELDS if name in set_here]
        if pod_wide:
            raise ValueError(
                f"placement.mode Groups runs a slice's roles in one pod: engine.roles."
                f"{role.value} may not set {', '.join(pod_wide)} (set it on engine)"
            )
