#!/usr/bin/env bash
# Installs what tests/test_resolver_slurm.py needs: Debian's Slurm (slurmctld, slurmd, clients)
# and munge. Nothing is started or configured here: the tests start their own throw-away
# munged/slurmctld/slurmd under a temporary directory and stop them afterwards.
# Idempotent; needs root (or sudo) and apt-get. Without apt-get it only says so, and the Slurm
# tests skip with that reason.
set -euo pipefail

have_all() {
  local c
  for c in munged slurmctld slurmd srun sbatch sinfo squeue scancel; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || return 1
  done
}

if have_all; then
  echo "install-slurm: Slurm and munge already installed"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-slurm: no apt-get here; install slurmctld, slurmd, slurm-client and munge" \
       "by hand (the Slurm tests skip until then)" >&2
  exit 0
fi
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -E "$@"; fi; }

# Keep the packages' maintainer scripts from starting system-wide daemons.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
  trap 'as_root rm -f "$policy"' EXIT
fi
packages=(slurmctld slurmd slurm-client munge)
export DEBIAN_FRONTEND=noninteractive
if ! as_root apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null 2>&1; then
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends "${packages[@]}"
fi
have_all || { echo "install-slurm: packages installed but programs missing" >&2; exit 1; }
echo "install-slurm: installed $(slurmctld -V 2>/dev/null || echo slurm)"
