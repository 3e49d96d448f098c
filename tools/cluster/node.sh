#!/usr/bin/env bash
# A real Kubernetes node beside the kwok GPU nodes: containerd + runc, the bridge CNI, a
# kubelet, kube-proxy (iptables) and CoreDNS, all on this host. up.sh and down.sh call it.
#
#   tools/cluster/node.sh check   # exit 0 when this host can run the node, else say why
#   tools/cluster/node.sh up      # after the control plane is up (needs root)
#   tools/cluster/node.sh down [--purge]  # undo every change `up` made to the host
#                                 # (--purge: the imported images and certificates too)
#   tools/cluster/node.sh import [ARCHIVE...]  # docker-archives into the node's containerd
#                                 # (default: the epd-*.tar tools/images/build.sh wrote)
#   tools/cluster/node.sh kubelet-stop|kubelet-start  # the kubelet alone (a lost node's
#                                 # drill: tests/k8s/test_real_node_lost.py); start waits for Ready
#
# The node is tainted epd.serving.dev/real-node=true:NoSchedule so that only pods that ask
# for it (the real-pod tests) land here; everything else keeps scheduling on kwok. Its IP is
# a /32 on one end of a veth pair (the kubelet refuses loopback). What `up` changes outside
# .build/node is recorded under .build/node/undo and reverted by `down`: iptables rules
# (saved before, restored after), sysctls, directories it created, mounts, the veth and the
# bridge, the kubepods cgroups. Facts behind the choices: ../shared/REAL-NODE.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${EPD_CLUSTER_BIN:-$root/.build/bin}"
cluster="${EPD_CLUSTER_DIR:-$root/.build/cluster}"
dir="${EPD_NODE_DIR:-$root/.build/node}"
run=/run/epd-node                        # sockets: unix paths must stay short
undo="$dir/undo"
node_name="${EPD_NODE_NAME:-epd-node-0}"
node_ip="${EPD_NODE_IP:-172.30.0.1}"
pod_cidr="${EPD_POD_CIDR:-10.88.0.0/16}"
bridge=epd-br0
veth=epd-node0
taint_key=epd.serving.dev/real-node
pause_image=registry.k8s.io/pause:3.10
cni_bin="${EPD_CNI_BIN:-/usr/lib/cni}"
kubeconfig="$cluster/kubeconfig"
images_dir="${EPD_IMAGES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/epd-operator/images}"
# containerd's root (the imported images, several GB for the engine) is a cache shared by
# every checkout, like the archives: a fresh clone does not import again. One node runs at a
# time (check refuses a second), so they never share it at once.
store="${EPD_NODE_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/epd-operator/node-containerd}"
ctr=(ctr --address "$run/containerd.sock" -n k8s.io)
# Host paths the kubelet, containerd and the CNI plugins write to whatever they are told.
host_dirs=(/var/lib/kubelet /var/log/containers /var/log/pods /usr/libexec/kubernetes
  /var/lib/cni /run/containerd /run/netns /etc/cni)
sysctls=(kernel.panic kernel.panic_on_oops vm.overcommit_memory net.ipv4.ip_forward
  net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables)

say() { echo "node.sh: $*" >&2; }

check() {  # prints why not, exit 1
  local why=()
  [[ $(id -u) == 0 ]] || why+=("needs root")
  for b in kubelet kube-proxy coredns pause; do
    [[ -x "$bin/$b" ]] || why+=("$bin/$b missing (make cluster-bins)")
  done
  for b in containerd containerd-shim-runc-v2 runc ctr iptables-save iptables-restore ip buildah; do
    command -v "$b" >/dev/null || why+=("'$b' missing (apt-get install containerd runc iptables iproute2 buildah)")
  done
  [[ -x "$cni_bin/bridge" && -x "$cni_bin/host-local" && -x "$cni_bin/portmap" ]] ||
    why+=("CNI plugins missing in $cni_bin (apt-get install containernetworking-plugins)")
  if [[ -S $run/containerd.sock && ! -f $dir/run/containerd.pid ]]; then
    why+=("another checkout's real node is running ($run): stop it with its tools/cluster/down.sh")
  fi
  if ((${#why[@]})); then
    printf 'node.sh: no real node: %s\n' "${why[@]}" >&2
    return 1
  fi
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_port() { local p="$1"; until port_free "$p"; do p=$((p + 1)); done; echo "$p"; }
launch() {  # name args...
  local name="$1"; shift
  setsid "$@" >"$dir/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$dir/run/$name.pid"
}
wait_for() {  # what seconds command...
  local what="$1" limit="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      say "$what not ready after ${limit}s; last log lines:"
      tail -n 20 "$dir/logs/"*.log >&2 || true
      return 1
    fi
    sleep 0.5
  done
}

cert() {  # name subject: a client certificate signed by the cluster CA
  local pki="$cluster/pki"
  [[ -f "$dir/pki/$1.crt" ]] && return
  openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$dir/pki/$1.key" \
    -out "$dir/pki/$1.csr" 2>/dev/null
  openssl x509 -req -in "$dir/pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 3650 -extfile "$pki/client.ext" -out "$dir/pki/$1.crt" 2>/dev/null
}
client_kubeconfig() {  # name: a kubeconfig for that certificate
  local server
  server="$(sed -n 's/.*server: "\([^"]*\)".*/\1/p' "$kubeconfig" | head -n1)"
  cat >"$dir/$1.kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters: [{name: epd-local, cluster: {server: "$server", certificate-authority: "$cluster/pki/ca.crt"}}]
users: [{name: $1, user: {client-certificate: "$dir/pki/$1.crt", client-key: "$dir/pki/$1.key"}}]
contexts: [{name: epd-local, context: {cluster: epd-local, user: $1}}]
current-context: epd-local
YAML
}

record_host() {  # what `down` restores; written once per up
  mkdir -p "$undo"
  iptables-save >"$undo/iptables.rules"
  ip6tables-save >"$undo/ip6tables.rules" 2>/dev/null || true
  nft list tables >"$undo/nft.tables" 2>/dev/null || true
  : >"$undo/sysctl.conf"
  for s in "${sysctls[@]}"; do
    v="$(sysctl -n "$s" 2>/dev/null)" && echo "$s=$v" >>"$undo/sysctl.conf"
  done
  : >"$undo/created-dirs"
  for d in "${host_dirs[@]}"; do [[ -e $d ]] || echo "$d" >>"$undo/created-dirs"; done
}

network_up() {
  ip link show "$veth" >/dev/null 2>&1 || ip link add "$veth" type veth peer name "${veth}p"
  ip addr replace "$node_ip/32" dev "$veth"
  ip link set "$veth" up
  ip link set "${veth}p" up
  mkdir -p "$dir/cni/net.d" "$dir/cni/ipam"
  cat >"$dir/cni/net.d/10-epd.conflist" <<JSON
{"cniVersion": "0.4.0", "name": "epd", "plugins": [
  {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$dir/cni/ipam",
            "ranges": [[{"subnet": "$pod_cidr"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
JSON
}

containerd_up() {
  mkdir -p "$run" "$dir/containerd" "$store"
  cat >"$dir/containerd/config.toml" <<TOML
version = 2
root = "$store/root"
state = "$run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$run/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  # The VM's capability set lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$cni_bin"
    conf_dir = "$dir/cni/net.d"
TOML
  launch containerd containerd --config "$dir/containerd/config.toml"
  wait_for containerd 30 "${ctr[@]}" version
}

import_image() {  # archive: a docker-archive tar into the node's image store (once per build)
  local stamp="$store/.$(basename "$1").imported" want names
  want="$(stat -c '%s %Y' "$1")"
  # The stamp names what the import made; it counts only while those images are still
  # there (the kubelet's eviction manager deletes unused images under disk pressure).
  if [[ -f $stamp && "$(head -n1 "$stamp")" == "$want" ]] && all_listed "$stamp"; then
    return 0
  fi
  local start=$SECONDS
  names="$("${ctr[@]}" images import "$1" | sed -n 's/^unpacking \([^ ]*\) .*/\1/p')"
  printf '%s\n%s\n' "$want" "$names" >"$stamp"
  # The image's previous build is no longer referenced; a lease deleted with --sync runs
  # containerd's garbage collection now, so its layers do not pile up on the disk.
  local lease
  lease="$("${ctr[@]}" leases create | awk '{print $1}')"
  "${ctr[@]}" leases delete --sync "$lease" >/dev/null
  say "imported $(basename "$1") in $((SECONDS - start)) s"
}

all_listed() {  # stamp: every image name on its lines 2.. is in the node's store
  local listed name
  listed="$("${ctr[@]}" images ls -q)"
  while read -r name; do
    [[ -z $name ]] || grep -qxF "$name" <<<"$listed" || return 1
  done < <(tail -n +2 "$1")
  # A stamp from before names were recorded proves nothing.
  [[ $(wc -l <"$1") -gt 1 ]]
}

import_images() {  # archives...: default every CPU image tools/images/build.sh wrote
  local archives=("$@") a
  # The GPU image (7 GB) is not run on this node (it has no GPU): not imported by default.
  ((${#archives[@]})) || mapfile -t archives < <(ls "$images_dir"/epd-*.tar 2>/dev/null | grep -v -- '-gpu-')
  for a in "${archives[@]}"; do [[ -f $a ]] && import_image "$a"; done
  return 0
}

pause_image_up() {
  local archive="$dir/images/pause.tar"
  if [[ ! -s $archive || "$bin/pause" -nt $archive ]]; then
    mkdir -p "$dir/images"
    local bh=(buildah --storage-driver "${BUILDAH_STORAGE:-overlay}") c
    c="$("${bh[@]}" from scratch)"
    "${bh[@]}" copy "$c" "$bin/pause" /pause >/dev/null
    "${bh[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$c"
    "${bh[@]}" commit --quiet "$c" epd-pause:dev >/dev/null
    "${bh[@]}" rm "$c" >/dev/null
    rm -f "$archive"
    "${bh[@]}" push --quiet epd-pause:dev "docker-archive:$archive:$pause_image"
  fi
  import_image "$archive"
}

kubelet_up() {
  cert "$node_name" "/O=system:nodes/CN=system:node:$node_name"
  client_kubeconfig "$node_name"
  local port healthz
  port="$(pick_port 10250)"
  healthz="$(pick_port 10248)"
  mkdir -p "$dir/kubelet" "$dir/pod-logs" "$dir/volume-plugins"
  cat >"$dir/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false          # this host has cgroup v1 only
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$run/containerd.sock
address: $node_ip
port: $port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$cluster/pki/ca.crt"}
authorization: {mode: Webhook}
clusterDomain: cluster.local
clusterDNS: [$node_ip]
failSwapOn: false
podLogsDir: $dir/pod-logs
volumePluginDir: $dir/volume-plugins
registerWithTaints: [{key: $taint_key, value: "true", effect: NoSchedule}]
# Imported images have no registry to come back from: never garbage-collect them. Under
# disk pressure the eviction manager deletes unused images too (CI lost both images that
# way), so its disk thresholds are absolute: a percentage of a large shared disk is GBs.
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: 200Mi, nodefs.available: 512Mi, imagefs.available: 512Mi}
serializeImagePulls: false
maxPods: 40
YAML
  launch kubelet "$bin/kubelet" --config "$dir/kubelet.yaml" --kubeconfig "$dir/$node_name.kubeconfig" \
    --root-dir "$dir/kubelet" --cert-dir "$dir/kubelet/pki" --node-ip "$node_ip" \
    --hostname-override "$node_name" --node-labels "epd.serving.dev/real-node=true" --v 1
  wait_for "node $node_name" 60 "$bin/kubectl" --kubeconfig "$kubeconfig" wait \
    --for=condition=Ready "node/$node_name" --timeout=1s
}

kube_proxy_up() {
  cert kube-proxy "/CN=system:kube-proxy"
  client_kubeconfig kube-proxy
  cat >"$dir/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$dir/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: $pod_cidr
hostnameOverride: $node_name
metricsBindAddress: 127.0.0.1:$(pick_port 10249)
healthzBindAddress: 127.0.0.1:$(pick_port 10256)
conntrack: {maxPerCore: 0}   # leave the host's nf_conntrack_max alone
YAML
  launch kube-proxy "$bin/kube-proxy" --config "$dir/kube-proxy.yaml" --v 1
}

coredns_up() {
  # Cluster DNS as a host process on the node IP (the kubelet points pods at it).
  cat >"$dir/Corefile" <<COREFILE
.:53 {
    bind $node_ip
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $kubeconfig epd-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    forward . /etc/resolv.conf
    cache 5
}
COREFILE
  launch coredns "$bin/coredns" -conf "$dir/Corefile"
}

up() {
  check
  [[ -f $kubeconfig ]] || { say "control plane not up (tools/cluster/up.sh)"; exit 1; }
  local start=$SECONDS
  mkdir -p "$dir/logs" "$dir/run" "$dir/pki"
  [[ -d $undo ]] || record_host
  network_up
  containerd_up
  pause_image_up
  import_images
  coredns_up
  kube_proxy_up
  kubelet_up
  say "node $node_name ($node_ip) Ready in $((SECONDS - start)) s"
}

stop_pid() {  # name
  local f="$dir/run/$1.pid" pid
  [[ -f $f ]] || return 0
  pid="$(cat "$f")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

kill_cgroup_tree() {  # every process in the kubepods cgroups, then the cgroups
  local h
  for h in /sys/fs/cgroup/*/kubepods; do
    [[ -d $h ]] || continue
    find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  sleep 0.3
  for h in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice; do
    [[ -d $h ]] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

restore_rules() {  # tool saved-rules: flush every table, then put back what was there before
  local tool="$1" table
  command -v "$tool" >/dev/null || return 0
  for table in filter nat mangle raw; do
    "$tool" -t "$table" -F 2>/dev/null || true
    "$tool" -t "$table" -X 2>/dev/null || true
  done
  [[ -s $2 ]] && "$tool-restore" <"$2" || true
}

drop_new_tables() {  # before: the (empty) nf_tables tables iptables-nft created stay otherwise
  command -v nft >/dev/null && [[ -f $1 ]] || return 0
  local table
  nft list tables 2>/dev/null | while read -r table; do
    grep -qxF "$table" "$1" || nft delete $table 2>/dev/null || true  # "table FAMILY NAME"
  done
}

remove_containers() {  # every task and container; the imported images stay for the next up
  "${ctr[@]}" version >/dev/null 2>&1 || return 0
  local id
  for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
    "${ctr[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    "${ctr[@]}" tasks rm -f "$id" >/dev/null 2>&1 || true
  done
  for id in $("${ctr[@]}" containers ls -q 2>/dev/null); do
    "${ctr[@]}" containers rm "$id" >/dev/null 2>&1 || true
  done
}

down() {
  [[ -d $dir ]] || return 0
  stop_pid kubelet
  stop_pid kube-proxy
  stop_pid coredns
  remove_containers
  pkill -9 -f "containerd-shim-runc-v2 .*-address $run/containerd.sock" 2>/dev/null || true
  kill_cgroup_tree
  stop_pid containerd
  # Mounts: pod volumes, container roots, sandboxes' network namespaces.
  findmnt -rn -o TARGET | grep -E "^($dir|$run|/run/netns/cni-)" | sort -r |
    xargs -r -n1 umount -l 2>/dev/null || true
  rm -f /run/netns/cni-* 2>/dev/null || true
  ip link del "$bridge" 2>/dev/null || true
  ip link del "$veth" 2>/dev/null || true
  if [[ -d $undo ]]; then
    restore_rules iptables "$undo/iptables.rules"
    restore_rules ip6tables "$undo/ip6tables.rules"
    drop_new_tables "$undo/nft.tables"
    while IFS== read -r key value; do sysctl -qw "$key=$value" || true; done <"$undo/sysctl.conf"
    while read -r d; do rm -rf "$d"; done <"$undo/created-dirs"
    rm -rf "$undo"
  fi
  rm -rf "$run" "$dir/kubelet" "$dir/cni/ipam" "$dir/run"
  ((purge)) && rm -rf "$dir" "$store"
  return 0
}

purge=0
[[ ${2:-} == --purge ]] && purge=1
case "${1:-}" in
  check) check ;;
  up) up ;;
  down) down ;;
  import) shift; import_images "$@" ;;
  kubelet-stop) stop_pid kubelet ;;
  kubelet-start) kubelet_up ;;
  *) echo "usage: $0 check|up|down [--purge]|import [ARCHIVE...]|kubelet-stop|kubelet-start" >&2
     exit 2 ;;
esac
