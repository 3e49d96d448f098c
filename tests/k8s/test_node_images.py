"""The real node's images come back when something took them out of its store.

Defect it prevents: ``node.sh import`` skipped an archive whose stamp matched, even when its
images were gone from the node's containerd (the kubelet's eviction manager deletes unused
images under disk pressure), so every real-pod test in a CI run failed with "images not on
the node" although ``make images`` had built them."""

from __future__ import annotations

from tests.k8s.conftest import Cluster
from tests.k8s.real_node import node_ctr, require_node_and_images

OPERATOR_IMAGE = "docker.io/library/epd-operator:dev"


def test_an_image_gone_from_the_node_is_imported_again(cluster: Cluster) -> None:
    require_node_and_images(cluster)  # imported (or skipped: no real node)
    node_ctr("images", "rm", "--sync", OPERATOR_IMAGE)
    assert OPERATOR_IMAGE not in node_ctr("images", "ls", "-q").split()

    require_node_and_images(cluster)  # node.sh import: the stamp alone no longer counts

    assert OPERATOR_IMAGE in node_ctr("images", "ls", "-q").split()
