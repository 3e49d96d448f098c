#!/usr/bin/env bash
# FlashInfer's kernels out of a built GPU image, as .fi/aot.tgz: what tools/gpu/aot_cold_start.py
# (the aot-cold-start step of tools/gpu/run-checks.sh) loads on a GPU machine, so that check runs
# the image's own kernels. Root, after `make images-gpu` (buildah's store).
#   tools/images/export_aot.sh [IMAGE]      # default epd-engine-gpu:${IMAGE_TAG:-dev}
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
image="${1:-epd-engine-gpu:${IMAGE_TAG:-dev}}"
bh=(buildah --storage-driver "${BUILDAH_STORAGE:-overlay}")
ctr=$("${bh[@]}" from --quiet "$image")
trap '"${bh[@]}" umount "$ctr" >/dev/null; "${bh[@]}" rm "$ctr" >/dev/null' EXIT
mnt=$("${bh[@]}" mount "$ctr")
aot=$(echo "$mnt"/opt/epd/lib/python3*/site-packages/flashinfer/data/aot)
mkdir -p "$root/.fi"
tar czf "$root/.fi/aot.tgz" -C "$aot" .
echo "$root/.fi/aot.tgz: $(du -h "$root/.fi/aot.tgz" | cut -f1) ($(ls "$aot" | wc -l) modules of $image)"
