#!/usr/bin/env bash
# Build the ROS 2 interface packages under interfaces/ (pacmod3_msgs) with plain cmake and install
# them into a Python venv that holds the ROS 2 wheels of requirements-ros.txt, for machines without a
# ROS distro. On the car the distro provides these packages: never run this there.
#
#   scripts/build_interfaces.sh VENV [PACKAGE_DIR ...]
#
# PACKAGE_DIR: interface packages to build (default: interfaces/pacmod3_msgs); extra cmake
# arguments come from INTERFACES_CMAKE_ARGS (scripts/install_launch_stack.sh builds
# composition_interfaces this way).
#
# Installs into the venv prefix itself: the generated libraries carry no RUNPATH, and the ROS wheels
# already put VENV/lib on the library path of every Python started from the venv.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 VENV [PACKAGE_DIR ...]" >&2
    exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
prefix="$(cd "$1" && pwd)"
python="$prefix/bin/python"
if [[ ! -x "$python" ]]; then
    echo "$0: no Python at $python" >&2
    exit 2
fi

shift
package_dirs=("$@")
if [[ ${#package_dirs[@]} -eq 0 ]]; then
    package_dirs=("$root/interfaces/pacmod3_msgs")
fi
read -r -a extra_cmake_args <<< "${INTERFACES_CMAKE_ARGS:-}"
for source_dir in "${package_dirs[@]}"; do
    source_dir="$(cd "$source_dir" && pwd)"
    package="$(basename "$source_dir")"
    # Build trees live in the venv, never in the source tree; a fresh one each time, so a moved
    # checkout or a changed venv never meets a stale CMake cache.
    build_dir="$prefix/build/interfaces/$package"
    log="$prefix/build/interfaces/$package.log"
    rm -rf "$build_dir"
    mkdir -p "$build_dir"
    echo "building $package into $prefix (log: $log)"
    # CMAKE_INSTALL_PREFIX must be the venv too: ament finds the installed typesupports through the
    # resource index under the install prefix (nothing sets AMENT_PREFIX_PATH here).
    if ! {
        cmake -S "$source_dir" -B "$build_dir" \
            -DCMAKE_PREFIX_PATH="$prefix" \
            -DCMAKE_INSTALL_PREFIX="$prefix" \
            -DPython3_EXECUTABLE="$python" \
            -DCMAKE_BUILD_TYPE=Release \
            -DBUILD_TESTING=OFF "${extra_cmake_args[@]}" &&
            cmake --build "$build_dir" --parallel "$(nproc)" &&
            cmake --install "$build_dir"
    } > "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "$0: building $package failed; full log: $log" >&2
        exit 1
    fi
done
