#!/usr/bin/env bash
# Start a real Kubernetes control plane on 127.0.0.1 from the binaries in .build/bin:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake GPU nodes),
# and, where this host can run one (root, containerd, runc, CNI plugins), a real node that
# runs containers (node.sh: kubelet, kube-proxy, CoreDNS).
#
#   EPD_REAL_NODE=auto (default): the real node when node.sh check passes, else say why
#   EPD_REAL_NODE=1: the real node or fail      EPD_REAL_NODE=0: kwok nodes only
#
#   tools/cluster/up.sh            # prints the kubeconfig path on its last line
#   KUBECONFIG=.build/cluster/kubeconfig kubectl get nodes
#
# Certificates and keys are generated once (openssl) under .build/cluster/pki; etcd starts
# empty on every up. If the control plane is already up, this only says so.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bin="${EPD_CLUSTER_BIN:-$root/.build/bin}"
dir="${EPD_CLUSTER_DIR:-$root/.build/cluster}"
kubeconfig="$dir/kubeconfig"
kubectl=("$bin/kubectl" --kubeconfig "$kubeconfig")

for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok kubectl; do
  [[ -x "$bin/$b" ]] || { echo "up.sh: $bin/$b missing; run 'make cluster-bins' first" >&2; exit 1; }
done
if [[ -f "$kubeconfig" ]] && "${kubectl[@]}" get --raw /readyz >/dev/null 2>&1; then
  echo "up.sh: control plane already up"
  echo "$kubeconfig"
  exit 0
fi
"$here/down.sh" --quiet || true
mkdir -p "$dir/pki" "$dir/logs" "$dir/run"

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_port() {  # first free port from $1 (steps of 2: etcd needs port and port+1)
  local p="$1"
  until port_free "$p" && port_free $((p + 1)); do p=$((p + 2)); done
  echo "$p"
}
etcd_port="${EPD_ETCD_PORT:-$(pick_port 23790)}"
api_port="${EPD_APISERVER_PORT:-$(pick_port 16443)}"
start=$SECONDS

real_node=0
case "${EPD_REAL_NODE:-auto}" in
  0) ;;
  1) "$here/node.sh" check && real_node=1 || exit 1 ;;
  *) "$here/node.sh" check && real_node=1 || echo "up.sh: kwok nodes only" >&2 ;;
esac
node_ip="${EPD_NODE_IP:-172.30.0.1}"
if ((real_node)); then
  # Pods reach the API server through the kubernetes Service (10.0.0.1:443 -> the node IP):
  # it listens beyond loopback and publishes its endpoint.
  api_reach=(--bind-address 0.0.0.0 --advertise-address "$node_ip" --endpoint-reconciler-type lease)
else
  api_reach=(--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --endpoint-reconciler-type none)
fi

# --- certificates ---------------------------------------------------------------------------
pki="$dir/pki"
if [[ ! -f "$pki/admin.crt" ]]; then
  ossl() { openssl "$@" 2>/dev/null; }
  ossl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=epd-local-ca" \
    -keyout "$pki/ca.key" -out "$pki/ca.crt"
  printf 'subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' > "$pki/apiserver.ext"
  ossl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr"
  ossl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$pki/apiserver.ext" -out "$pki/apiserver.crt"
  printf 'extendedKeyUsage=clientAuth\n' > "$pki/client.ext"
  ossl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=epd-admin" -keyout "$pki/admin.key" -out "$pki/admin.csr"
  ossl x509 -req -in "$pki/admin.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$pki/client.ext" -out "$pki/admin.crt"
  ossl genrsa -out "$pki/sa.key" 2048
  ossl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
fi
cat > "$kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters:
- name: epd-local
  cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$pki/ca.crt"}
users:
- name: epd-admin
  user: {client-certificate: "$pki/admin.crt", client-key: "$pki/admin.key"}
contexts:
- name: epd-local
  context: {cluster: epd-local, user: epd-admin}
current-context: epd-local
YAML

launch() {  # name args... : start in its own session, remember the pid
  local name="$1"; shift
  setsid "$@" >"$dir/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$dir/run/$name.pid"
}
wait_for() {  # what seconds command...
  local what="$1" limit="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      echo "up.sh: $what not ready after ${limit}s; last log lines:" >&2
      tail -n 30 "$dir/logs/"*.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
}

# --- etcd -----------------------------------------------------------------------------------
rm -rf "$dir/etcd"
launch etcd "$bin/etcd" --name epd-local --data-dir "$dir/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
  --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
  --initial-cluster "epd-local=http://127.0.0.1:$((etcd_port + 1))" \
  --unsafe-no-fsync --quota-backend-bytes $((2 * 1024 * 1024 * 1024)) \
  --log-level warn
wait_for etcd 30 curl -sf "http://127.0.0.1:$etcd_port/health"

# --- kube-apiserver -------------------------------------------------------------------------
launch kube-apiserver "$bin/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$etcd_port" \
  "${api_reach[@]}" --secure-port "$api_port" \
  --cert-dir "$dir/run" --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
  --client-ca-file "$pki/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --service-cluster-ip-range 10.0.0.0/24 \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction --allow-privileged=true \
  --kubelet-client-certificate "$pki/admin.crt" --kubelet-client-key "$pki/admin.key" \
  --kubelet-preferred-address-types InternalIP,Hostname \
  --enable-priority-and-fairness=false \
  --v 1
wait_for kube-apiserver 90 "${kubectl[@]}" get --raw /readyz

# --- controllers, scheduler, kwok -----------------------------------------------------------
launch kube-controller-manager "$bin/kube-controller-manager" \
  --kubeconfig "$kubeconfig" --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false \
  --root-ca-file "$pki/ca.crt" --service-account-private-key-file "$pki/sa.key" \
  --use-service-account-credentials=false \
  --concurrent-deployment-syncs 10 --concurrent-replicaset-syncs 10 --concurrent-gc-syncs 20 \
  --v 1
launch kube-scheduler "$bin/kube-scheduler" \
  --kubeconfig "$kubeconfig" --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false --v 1
launch kwok "$bin/kwok" --kubeconfig "$kubeconfig" --config "$bin/kwok.yaml" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
  --manage-nodes-with-label-selector "" \
  --cidr 10.0.1.0/24 --node-ip 10.0.2.1

"$here/nodes.sh" | "${kubectl[@]}" apply -f - >/dev/null
wait_for "fake GPU nodes" 60 "${kubectl[@]}" wait --for=condition=Ready node --all --timeout=1s
wait_for "default service account" 60 "${kubectl[@]}" get serviceaccount default -n default
if ((real_node)) && ! "$here/node.sh" up; then
  [[ ${EPD_REAL_NODE:-auto} == 1 ]] && exit 1
  echo "up.sh: the real node did not start (logs in .build/node/logs); kwok nodes only" >&2
  "$here/node.sh" down || true
fi
echo "up.sh: control plane up in $((SECONDS - start)) s (kubectl --kubeconfig $kubeconfig)"
echo "$kubeconfig"
