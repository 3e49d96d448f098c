#!/usr/bin/env bash
# Print the fake GPU nodes (kwok) as a YAML stream: two node types.
#   h100: 2 nodes x 8 nvidia.com/gpu     l4: 2 nodes x 4 nvidia.com/gpu     (24 GPUs in all)
#   cpu:  1 node without GPUs or taints (router pods)
set -euo pipefail
node() {  # name product gpus cpu memory
  cat <<YAML
---
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: $1
    node.kubernetes.io/instance-type: kwok-$2
YAML
  if [[ $3 != 0 ]]; then
    cat <<YAML
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.product: $2
spec:
  taints:
  - key: nvidia.com/gpu
    value: present
    effect: NoSchedule
YAML
  fi
  cat <<YAML
status:
  allocatable: {cpu: "$4", memory: $5, pods: "110", nvidia.com/gpu: "$3"}
  capacity: {cpu: "$4", memory: $5, pods: "110", nvidia.com/gpu: "$3"}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
YAML
}
node gpu-h100-0 NVIDIA-H100-80GB-HBM3 8 96 1024Gi
node gpu-h100-1 NVIDIA-H100-80GB-HBM3 8 96 1024Gi
node gpu-l4-0 NVIDIA-L4 4 48 192Gi
node gpu-l4-1 NVIDIA-L4 4 48 192Gi
node cpu-0 cpu 0 32 128Gi
