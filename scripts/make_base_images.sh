#!/usr/bin/env bash
# Base images built from Debian's packages, for hosts that reach a Debian mirror but no image
# registry (no `FROM python:...`, no `redis:...` pulls). Makes, unless they already exist:
#
#   oldlogit-local/debian:bookworm       debootstrap --variant=minbase, imported with `docker import`
#   oldlogit-local/python:3.11-bookworm  + python3, python3-venv  (a BASE_IMAGE for the Dockerfile)
#   oldlogit-local/redis:7-bookworm      + redis-server, runs as `redis` in /data (the compose Redis)
#
# Usage: scripts/make_base_images.sh [--force]   (root, docker, debootstrap; about a minute)
# Then:  make image BASE_IMAGE=oldlogit-local/python:3.11-bookworm
#        OLDLOGIT_REDIS_IMAGE=oldlogit-local/redis:7-bookworm docker compose up -d
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), LOCAL_IMAGE_PREFIX.
set -euo pipefail

PREFIX=${LOCAL_IMAGE_PREFIX:-oldlogit-local}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
DEBIAN_IMAGE="$PREFIX/debian:$SUITE"
PYTHON_IMAGE="$PREFIX/python:3.11-$SUITE"
REDIS_IMAGE="$PREFIX/redis:7-$SUITE"
force=0
[[ ${1:-} == --force ]] && force=1

have() { [[ $force == 0 ]] && docker image inspect "$1" >/dev/null 2>&1; }
say() { echo "make_base_images: $*"; }

if have "$DEBIAN_IMAGE"; then
  say "$DEBIAN_IMAGE exists"
else
  command -v debootstrap >/dev/null || {
    say "needs debootstrap (apt-get install -y debootstrap) and root" >&2
    exit 1
  }
  rootfs=$(mktemp -d /tmp/oldlogit-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap $SUITE from $MIRROR"
  start=$SECONDS
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || {
    tail -20 "$rootfs.log" >&2
    exit 1
  }
  rm -f "$rootfs.log"
  # What the official Debian images do: updates and security in the sources, no docs, man
  # pages or translations installed later, no apt caches kept.
  mirror_root=${MIRROR%/debian}
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $mirror_root/debian-security $SUITE-security main
EOF
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/oldlogit-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  cat >"$rootfs/etc/apt/apt.conf.d/oldlogit-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOF
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
  tar -C "$rootfs" -c . | docker import --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  say "$DEBIAN_IMAGE imported ($((SECONDS - start)) s)"
fi

# The legacy builder reads the Dockerfile from stdin with no context; --network host because a
# build container may have no route out on such hosts.
build() {
  local tag=$1
  if have "$tag"; then
    say "$tag exists"
    return
  fi
  local start=$SECONDS
  DOCKER_BUILDKIT=0 docker build -q --network host -t "$tag" - >/dev/null
  say "$tag built ($((SECONDS - start)) s)"
}

build "$PYTHON_IMAGE" <<EOF
FROM $DEBIAN_IMAGE
RUN apt-get update \\
    && apt-get install -y --no-install-recommends python3 python3-venv \\
    && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
EOF

# Like the official image: redis-server as the unprivileged `redis` user, data in /data (the
# working directory, so --appendonly files land on the volume mounted there).
build "$REDIS_IMAGE" <<EOF
FROM $DEBIAN_IMAGE
RUN apt-get update \\
    && apt-get install -y --no-install-recommends redis-server redis-tools \\
    && rm -rf /var/lib/apt/lists/* \\
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
VOLUME /data
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no"]
EOF

docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep "^$PREFIX/" || true
