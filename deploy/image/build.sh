#!/usr/bin/env bash
# ferry's container image, made here from Debian's packages (no base image is pulled): a
# Debian 12 root file system by mmdebstrap holding the packages that own the libraries ferryd
# and the ferry CLI load, the two binaries, a user "ferry" (uid 10001) it runs as, packaged as
# an OCI image layout by umoci. Entry point ferryd; health check `ferry health` (an OCI image
# config has no health check field: Kubernetes probes and `podman run --health-cmd` name it).
#
#   bash deploy/image/build.sh [OUT]      as root; OUT defaults to $FERRY_BUILD_DIR/image
#
# Prints the image reference (oci:OUT/layout:ferry-VERSION) on its last line; `podman pull`
# takes it. Environment: FERRY_BUILD_DIR (default: build), FERRY_MIRROR (default:
# http://deb.debian.org/debian), FERRY_IMAGE_COPY (directories copied into the image as they
# are, at the same path: /opt/amazon/efa for a ferry built against the EFA installer's
# libfabric, whose provider plugins are loaded at run time). Libraries a binary loads that no
# Debian package owns (that libfabric's) are copied at their path and given to ld.so.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${FERRY_BUILD_DIR:-$root/build}
out=${1:-$build/image}
mirror=${FERRY_MIRROR:-http://deb.debian.org/debian}
version=$(sed -n 's/^project(ferry VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
tag=ferry-$version
bins=("$build/server/ferryd" "$build/client/ferry")
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "build.sh: no $b (build ferry first)" >&2; exit 1; }
done

# The packages that own the binaries' shared libraries; the libraries no package owns.
declare -A packages=()
unowned=()
while read -r lib; do
  owner=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$(realpath "$lib")" 2>/dev/null || true)
  if [ -n "$owner" ]; then
    packages[${owner%%:*}]=1
  else
    unowned+=("$(realpath "$lib")")
  fi
done < <(ldd "${bins[@]}" | awk '/=> \// {print $3}' | sort -u)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"
mkdir -p "$out"
echo "build.sh: Debian 12 with ${!packages[*]}" >&2
mmdebstrap --quiet --variant=essential --include="$(IFS=,; echo "${!packages[*]}")" \
  bookworm "$work/rootfs.tar" "$mirror"

umoci init --layout "$out/layout"
umoci new --image "$out/layout:$tag"
umoci unpack --image "$out/layout:$tag" "$work/bundle"
fs=$work/bundle/rootfs
tar -C "$fs" -xf "$work/rootfs.tar"
install -m 0755 "${bins[@]}" "$fs/usr/local/bin/"
for dir in ${FERRY_IMAGE_COPY:-}; do
  mkdir -p "$fs$(dirname "$dir")"
  cp -a "$dir" "$fs$(dirname "$dir")/"
done
if [ ${#unowned[@]} -gt 0 ]; then
  for lib in "${unowned[@]}"; do
    mkdir -p "$fs$(dirname "$lib")"
    cp -aL "$lib" "$fs$lib"
    dirname "$lib" >> "$fs/etc/ld.so.conf.d/ferry.conf"
  done
  chroot "$fs" /sbin/ldconfig
fi
echo "ferry:x:10001:10001:ferry:/var/lib/ferry:/usr/sbin/nologin" >> "$fs/etc/passwd"
echo "ferry:x:10001:" >> "$fs/etc/group"
mkdir -p "$fs/var/lib/ferry" "$fs/etc/ferry"
chown 10001:10001 "$fs/var/lib/ferry"
umoci repack --image "$out/layout:$tag" "$work/bundle"

# Default arguments: every address, the catalog in /var/lib/ferry (a volume), the token from
# /etc/ferry/token (a mounted secret). A deployment passes its own (deploy/k8s).
umoci config --image "$out/layout:$tag" \
  --config.user 10001:10001 \
  --config.workingdir /var/lib/ferry \
  --config.entrypoint /usr/local/bin/ferryd \
  --config.cmd --listen --config.cmd 0.0.0.0:7070 \
  --config.cmd --data-dir --config.cmd /var/lib/ferry \
  --config.cmd --token-file --config.cmd /etc/ferry/token \
  --config.exposedports 7070/tcp \
  --config.volume /var/lib/ferry \
  --config.label "org.opencontainers.image.title=ferry" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "io.ferry.healthcheck=ferry --node http://127.0.0.1:7070 health"
umoci gc --layout "$out/layout"
echo "oci:$out/layout:$tag"
