#!/usr/bin/env bash
# Build the images without a Docker daemon (root): a Debian base bootstrapped locally with
# debootstrap, both Dockerfiles built on it with buildah (vfs storage, chroot isolation), and
# each image written as a docker-archive that `ctr -n k8s.io images import` accepts.
#
#   tools/images/build.sh [operator|engine|engine-gpu ...]     # default: operator engine
# engine-gpu is docker/engine.Dockerfile with VARIANT=gpu (`make images-gpu`).
#   needs: apt-get install -y buildah debootstrap   (Debian bookworm packages)
#
# Archives and timings go to $EPD_IMAGES_DIR (default ~/.cache/epd-operator/images, outside
# the checkout so a fresh clone reuses them; an archive is rewritten only when its image
# changed). The base is built once and reused; unchanged build steps come from buildah's cache.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${EPD_IMAGES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/epd-operator/images}"
tag="${IMAGE_TAG:-dev}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base="localhost/epd-base:$suite"
# overlay (copy-on-write layers) where the kernel allows it; vfs copies the whole root per layer.
bh=(buildah --storage-driver "${BUILDAH_STORAGE:-overlay}")
mkdir -p "$out"
timings="$out/timings.txt"

if ! "${bh[@]}" inspect --type image "$base" >/dev/null 2>&1; then
  start=$SECONDS
  rootfs="$out/rootfs-$suite"
  rm -rf "$rootfs"
  # python3-venv: the Dockerfiles install into a virtual environment (Debian's Python
  # refuses system-wide pip installs, PEP 668).
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$rootfs" "$mirror"
  ctr=$("${bh[@]}" from scratch)
  mnt=$("${bh[@]}" mount "$ctr")
  cp -a "$rootfs"/. "$mnt"/
  # Trust what this host trusts (a TLS-intercepting egress proxy's CA, say), so pip in the
  # builds reaches the package index; the base image is local, never pushed.
  host_ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
  if [[ -f "$host_ca" ]]; then
    mkdir -p "$mnt/etc/ssl/certs"
    cp "$host_ca" "$mnt/etc/ssl/certs/ca-certificates.crt"
    "${bh[@]}" config --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
      --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "$ctr"
  fi
  "${bh[@]}" umount "$ctr"
  "${bh[@]}" commit --quiet "$ctr" "$base"
  "${bh[@]}" rm "$ctr" >/dev/null
  rm -rf "$rootfs"
  echo "base $base: $((SECONDS - start)) s" | tee -a "$timings"
fi

images=("$@")
[[ ${#images[@]} -gt 0 ]] || images=(operator engine)
for image in "${images[@]}"; do
  start=$SECONDS
  # --layers: an unchanged step (the dependency install above all) comes from the cache.
  dockerfile=$image variant=()
  if [[ $image == *-gpu ]]; then dockerfile=${image%-gpu} variant=(--build-arg VARIANT=gpu); fi
  previous="$("${bh[@]}" inspect --type image --format '{{.FromImageID}}' "epd-$image:$tag" 2>/dev/null || true)"
  "${bh[@]}" build --layers --isolation chroot --build-arg "BASE=$base" "${variant[@]}" \
    -f "$root/docker/$dockerfile.Dockerfile" -t "epd-$image:$tag" "$root"
  archive="$out/epd-$image-$tag.tar"
  id="$("${bh[@]}" inspect --type image --format '{{.FromImageID}}' "epd-$image:$tag")"
  # The tag's previous build is left untagged: remove it, or every rebuild keeps its GBs
  # (an image another still builds on is refused, and kept).
  if [[ -n $previous && $previous != "$id" ]]; then
    "${bh[@]}" rmi "$previous" >/dev/null 2>&1 || true
  fi
  if [[ -s $archive && "$(cat "$archive.id" 2>/dev/null)" == "$id" ]]; then
    echo "epd-$image:$tag: unchanged ($id), archive kept"
  else
    rm -f "$archive" "$archive.id"
    "${bh[@]}" push "epd-$image:$tag" "docker-archive:$archive:epd-$image:$tag"
    echo "$id" >"$archive.id"
  fi
  echo "epd-$image:$tag: $((SECONDS - start)) s -> $archive ($(du -m "$archive" | cut -f1) MB)" \
    | tee -a "$timings"
done
