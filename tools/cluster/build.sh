#!/usr/bin/env bash
# Build the local test control plane from pinned Go modules into .build/bin (cached).
#
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  <- tools/cluster/go.mod
#   kubelet, kube-proxy (the real node)                                    <- tools/cluster/go.mod
#   kwok                                                                   <- tools/cluster/kwok/go.mod
#   helm                                                                   <- tools/cluster/helm/go.mod
#   coredns (the real node's cluster DNS)                                  <- tools/cluster/coredns/go.mod
#   pause (the pod sandbox's process), from the kubernetes module's pause.c with gcc -static
#
# A binary is rebuilt only when its go.mod/go.sum changed (stamp per module), so a
# second run takes well under a second. Go's own module and build caches make a
# rebuild after a version bump incremental.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${EPD_CLUSTER_BIN:-$root/.build/bin}"
mkdir -p "$bin"

command -v go >/dev/null || { echo "build.sh: 'go' (>= 1.24) is required to build the control plane" >&2; exit 1; }

export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=readonly -trimpath"
ldflags="-s -w"

# Stamp the Kubernetes version like the release build does (hack/lib/version.sh): without it
# the API server reports v0.0.0-master and `helm install` refuses charts with a kubeVersion.
k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v1\./ {print $2; exit}' "$here/go.mod")"
[[ -n $k8s_version ]] || { echo "build.sh: no k8s.io/kubernetes version in go.mod" >&2; exit 1; }
k8s_minor="$(cut -d. -f2 <<<"$k8s_version")"
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# build_module DIR STAMP_NAME OUT_NAME=PACKAGE...
build_module() {
  local dir="$1" stamp_name="$2"; shift 2
  local stamp="$bin/.$stamp_name.stamp" want missing=0 spec
  want="$(cat "$dir/go.mod" "$dir/go.sum" "$here/build.sh" | sha256sum | cut -d' ' -f1)"
  for spec in "$@"; do [[ -x "$bin/${spec%%=*}" ]] || missing=1; done
  if [[ $missing == 0 && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "build.sh: $stamp_name up to date"
    return
  fi
  local start=$SECONDS
  for spec in "$@"; do
    echo "build.sh: building ${spec%%=*} (${spec#*=})"
    local flags="$ldflags"
    [[ $stamp_name == kubernetes ]] && flags+="$k8s_ldflags"
    (cd "$dir" && go build -ldflags="$flags" -o "$bin/${spec%%=*}" "${spec#*=}")
  done
  echo "$want" > "$stamp"
  echo "build.sh: $stamp_name built in $((SECONDS - start)) s"
}

build_module "$here" kubernetes \
  etcd=go.etcd.io/etcd/server/v3 \
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler \
  kubectl=k8s.io/kubernetes/cmd/kubectl \
  kubelet=k8s.io/kubernetes/cmd/kubelet \
  kube-proxy=k8s.io/kubernetes/cmd/kube-proxy
build_module "$here/kwok" kwok kwok=sigs.k8s.io/kwok/cmd/kwok
build_module "$here/helm" helm helm=helm.sh/helm/v3/cmd/helm
build_module "$here/coredns" coredns coredns=github.com/coredns/coredns

# The sandbox's PID 1, as the kubernetes release builds it (build/pause/linux/pause.c).
if [[ ! -x "$bin/pause" || "$bin/.kubernetes.stamp" -nt "$bin/pause" ]]; then
  command -v gcc >/dev/null || { echo "build.sh: 'gcc' is required to build pause" >&2; exit 1; }
  k8s_src="$(cd "$here" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)"
  gcc -Os -static -DVERSION="$k8s_version" -o "$bin/pause" "$k8s_src/build/pause/linux/pause.c"
  strip "$bin/pause"
fi

# kwok's stages (what happens to fake nodes and pods), from the same pinned module.
if [[ ! -s "$bin/kwok.yaml" || "$bin/.kwok.stamp" -nt "$bin/kwok.yaml" ]]; then
  kwok_src="$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  {
    for f in node/fast/node-initialize node/heartbeat/node-heartbeat \
      pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
      echo "---"
      cat "$kwok_src/kustomize/stage/$f.yaml"
    done
  } > "$bin/kwok.yaml"
fi
echo "build.sh: binaries in $bin"
