#!/usr/bin/env bash
# The Debian packages the emulated-cluster tests need, installed with apt-get when missing (root only).
#   tests/cluster/system-packages.sh [ssh] [slurm] [sge]     (no argument: all three)
# hora.testing.emulate never installs anything itself; ./dev setup and tests/cluster/conftest.py run this.
# Without root or apt-get it says so and exits 0: the tests then skip, naming the apt-get command.
set -euo pipefail
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(ssh slurm sge)
packages=()
for group in "${groups[@]}"; do
    case "$group" in
        ssh) packages+=(openssh-server openssh-client rsync) ;;
        slurm) packages+=(slurm-wlm) ;;
        sge) packages+=(gridengine-master gridengine-exec gridengine-client) ;;
        *) echo "system-packages.sh: unknown group $group (ssh, slurm or sge)" >&2; exit 2 ;;
    esac
done
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f '${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
done
[ ${#missing[@]} -gt 0 ] || exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "system-packages.sh: not root or no apt-get; the emulated-cluster tests need: apt-get install -y ${missing[*]}" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# Without a master host name, gridengine-common leaves act_qmaster empty; the emulated cluster writes
# its own cell anyway, so the package's automatic configuration is turned off.
printf '%s\n' "gridengine-common shared/gridenginemaster string localhost" \
    "gridengine-common shared/gridenginecell string default" \
    "gridengine-common shared/gridengineconfig boolean false" | debconf-set-selections
install() { apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
if ! install; then
    apt-get update >/dev/null  # stale package lists: refresh once and retry
    install
fi
