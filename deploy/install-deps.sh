#!/usr/bin/env bash
# Installs the Debian 12 packages that ferry's build, tests and benchmarks need.
# Idempotent: packages already present are left as they are. Run as root (or through sudo).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git clang clang-format libclang-rt-14-dev
  libfabric-dev libfabric-bin
  librocksdb-dev libhwloc-dev libcpp-httplib-dev libfmt-dev nlohmann-json3-dev
  libabsl-dev libspdlog-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev
  iproute2 iperf3 curl openssl
  python3 python3-numpy python3-pytest python3-yaml wget aria2
  prometheus chromium etcd-server etcd-client
  mmdebstrap umoci podman runc
)
# kubectl: Debian's kubernetes-client, unless the machine has a kubectl already (another
# package of it owns the same file).
command -v kubectl > /dev/null || packages+=(kubernetes-client)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
