#!/usr/bin/env bash
# Makes the base image `regatta-base:bookworm` from Debian's package archive with
# debootstrap (no registry pull needed), for machines where no image can be pulled.
# Idempotent: does nothing when the image exists (set REGATTA_REBUILD_BASE=1 to redo).
# Users with registry access can skip this and build FROM debian:bookworm-slim.
set -euo pipefail

image="${REGATTA_BASE_IMAGE:-regatta-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if [ -z "${REGATTA_REBUILD_BASE:-}" ] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "base image $image exists"
    exit 0
fi

sudo_cmd=""
[ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
if ! command -v debootstrap >/dev/null 2>&1; then
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq debootstrap >/dev/null
fi

rootfs="$(mktemp -d -t regatta-rootfs.XXXXXX)"
trap '$sudo_cmd rm -rf "$rootfs"' EXIT
echo "debootstrapping Debian bookworm (minbase) into $rootfs"
$sudo_cmd debootstrap --variant=minbase --include=ca-certificates,procps bookworm "$rootfs" "$mirror" >/dev/null
# Keep the image small: package lists and caches are not needed at run time.
$sudo_cmd rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
$sudo_cmd tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "built base image $image"
