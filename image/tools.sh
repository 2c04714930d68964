#!/usr/bin/env bash
# The container tools `make image` and its test use: buildah (builds from the Containerfile
# without a daemon), debootstrap (the base root filesystem, since no base image can be pulled),
# runc (runs the image; crun fails on some kernels' cgroups), skopeo (pushes the OCI archive)
# and umoci (unpacks it into a runtime bundle). All five are Debian packages of the same names.
#
# Installed with apt when missing and we are root. Otherwise: one line naming what is missing
# and how to get it, then exit 2 — or, with --or-skip (`make test`), exit 0 so that only the
# image test skips (it says why itself).
set -euo pipefail

TOOLS=(buildah debootstrap runc skopeo umoci)

# debootstrap and runc live in /usr/sbin, which a non-root PATH often lacks.
# CONTAINER_TOOLS_PATH: where to look instead (the bad-input test points it at nothing).
search=${CONTAINER_TOOLS_PATH-$PATH:/usr/sbin:/sbin}
missing=()
for tool in "${TOOLS[@]}"; do
	PATH=$search command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
	exit 0
fi

message="container tools missing: ${missing[*]} (Debian packages of the same names: sudo apt-get install ${missing[*]}, or run make as root, which installs them)"
if [ "${1:-}" = --or-skip ]; then
	echo "$message: the container image test will skip"
	exit 0
fi
echo "make image: $message" >&2
exit 2
