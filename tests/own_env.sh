#!/usr/bin/env bash
# The smoke tests of a simulator that pins its own MuJoCo, run in an environment of its own (what the main venv and
# CI's README command skip, with this script named as the fix):
#     bash tests/own_env.sh gym-hil      # env.adapter franka_sim   (~1 min; ~100 MB of wheels)
#     bash tests/own_env.sh libero       # env.adapter libero       (~3 min; ~350 MB of wheels)
#     bash tests/own_env.sh metaworld    # env.adapter metaworld
#     bash tests/own_env.sh maniskill    # env.adapter maniskill    (without a Vulkan device: checks the error)
# The venv is .venv-<extra> in the repo root, reused on later runs. Extra pytest arguments follow the extra.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:?usage: bash tests/own_env.sh gym-hil|libero|maniskill|metaworld [pytest args]}"
shift
case "$extra" in
    gym-hil) tests=(tests/integration/test_own_env_sims.py -k franka_sim) ;;
    libero) tests=(tests/integration/test_own_env_sims.py -k libero) ;;
    maniskill) tests=(tests/integration/test_own_env_sims.py -k maniskill) ;;
    metaworld) tests=(tests/unit/test_pixel_adapters.py tests/e2e/test_adapter_smoke.py -k metaworld) ;;
    *) echo "unknown extra '$extra': one of gym-hil, libero, maniskill, metaworld" >&2; exit 2 ;;
esac
# Headless rendering: OSMesa (Debian's libosmesa6) on the CPU, as CI installs it.
ldconfig -p | grep -q libOSMesa || { echo "needs Debian's libosmesa6: apt-get install -y libosmesa6" >&2; exit 1; }
venv=".venv-$extra"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extra]" pytest pytest-timeout
exec "$venv/bin/python" -m pytest -p no:cacheprovider -rs "${tests[@]}" "$@"
