#!/usr/bin/env bash
# Debian packages the tests need (a local SLURM cluster: slurm + munge). Installed only when run as root
# and only when missing; otherwise says what is missing and continues (SLURM tests then skip with that reason).
set -euo pipefail
need=()
for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "note: missing ${need[*]} (slurm/munge); run as root or 'apt-get install slurmctld slurmd slurm-client munge'" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
echo "installed slurm + munge"
