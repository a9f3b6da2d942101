#!/usr/bin/env bash
# Build rmw_cyclonedds_cpp, the ROS 2 middleware over Cyclone DDS, with plain cmake against the ROS 2
# wheels of requirements-ros.txt and the system's Cyclone DDS (Debian/Ubuntu cyclonedds-dev 0.10.x,
# which has the DDS Security plugins the PyPI Fast DDS lacks), for machines without a ROS distro
# that must run the graph secured. On the car the distro's rmw (Fast DDS or Cyclone DDS) has DDS
# Security: never run this there.
#
#   scripts/build_rmw_cyclonedds.sh VENV SOURCE PREFIX
#
# SOURCE: the ros2/rmw_cyclonedds repository's tree (e.g. `git archive rolling | tar -x -C SOURCE`);
# PREFIX: where it is installed, outside this repository (e.g. /opt/rmw_cyclonedds). Source
# PREFIX/setup.bash after VENV's activate, then RMW_IMPLEMENTATION=rmw_cyclonedds_cpp.
set -euo pipefail

if [[ $# -ne 3 ]]; then
    echo "usage: $0 VENV SOURCE PREFIX" >&2
    exit 2
fi
venv="$(cd "$1" && pwd)"
upstream="$(cd "$2/rmw_cyclonedds_cpp" && pwd)"
mkdir -p "$3"
prefix="$(cd "$3" && pwd)"
python="$venv/bin/python"
if [[ ! -x "$python" ]]; then
    echo "$0: no Python at $python" >&2
    exit 2
fi
plugins="$(dirname "$(ls /usr/lib/*/libddsc0debian/libdds_security_auth.so 2>/dev/null | head -n1)")"
if [[ ! -f "$plugins/libdds_security_auth.so" ]]; then
    echo "$0: no Cyclone DDS Security plugins (apt-get install cyclonedds-dev)" >&2
    exit 2
fi

# The wheels ship ament_cmake_ros_core but not ament_cmake_ros, which the package asks for; the part
# it uses (BUILD_SHARED_LIBS defaults) is in the core package.
shim="$prefix/build/shim"
mkdir -p "$shim"
echo 'find_package(ament_cmake_ros_core REQUIRED)' > "$shim/ament_cmake_rosConfig.cmake"
# The tracetools wheel names lttng-ust, which it bundles under a hashed name (auditwheel) that its
# own RUNPATH finds; the rmw calls only tracetools, so lttng-ust is dropped from what it links.
cat > "$shim/drop_lttng.cmake" <<'CMAKE'
function(drop_lttng)
  get_target_property(libraries tracetools::tracetools INTERFACE_LINK_LIBRARIES)
  list(REMOVE_ITEM libraries lttng-ust)
  set_target_properties(tracetools::tracetools PROPERTIES INTERFACE_LINK_LIBRARIES "${libraries}")
endfunction()
cmake_language(DEFER CALL drop_lttng)
CMAKE

# What the wheels' bootstrapper puts on LD_LIBRARY_PATH: the venv's lib and the wheels' bundled
# libraries (auditwheel's ros_*.libs).
rpath="$(cd "$venv" && "$python" -c 'import os, sys, glob; print(";".join([os.path.join(sys.prefix, "lib")] + sorted(glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "ros_*.libs")))))')"
build_dir="$prefix/build/rmw_cyclonedds_cpp"
log="$prefix/build/rmw_cyclonedds_cpp.log"
source_dir="$prefix/build/source"
rm -rf "$build_dir" "$source_dir"
# The newest upstream in reach (3.2.0, rolling of December 2024) predates Kilted's move of the
# enclave file lookup from rmw_dds_common to rmw_security_common, which the wheels have: patched
# to use it, on a copy.
cp -r "$upstream" "$source_dir"
patch -s -d "$source_dir" -p1 < "$(dirname "$0")/rmw_cyclonedds_kilted.patch"
echo "building rmw_cyclonedds_cpp into $prefix (log: $log)"
# The typesupports are found through the ament index of the venv prefix.
if ! {
    AMENT_PREFIX_PATH="$venv" cmake -S "$source_dir" -B "$build_dir" \
        -DCMAKE_PREFIX_PATH="$venv" \
        -Dament_cmake_ros_DIR="$shim" \
        -DCMAKE_PROJECT_INCLUDE="$shim/drop_lttng.cmake" \
        -DCMAKE_INSTALL_PREFIX="$prefix" \
        -DCMAKE_INSTALL_RPATH="$rpath" -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--disable-new-dtags \
        -DPython3_EXECUTABLE="$python" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_TESTING=OFF &&
        cmake --build "$build_dir" --parallel "$(nproc)" &&
        cmake --install "$build_dir"
} > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "$0: building rmw_cyclonedds_cpp failed; full log: $log" >&2
    exit 1
fi

# An RPATH, not a RUNPATH, to the venv's libraries: it also finds the wheels' libraries' own
# dependencies, when the library is preloaded before the venv's Python has set LD_LIBRARY_PATH.
# The wheels' rcl links rmw_fastrtps_cpp itself (no rmw_implementation, so RMW_IMPLEMENTATION
# cannot choose): preloaded, this library's rmw_* functions take the place of Fast DDS's in every
# process started with it. Cyclone DDS dlopens its security plugins by name; Debian keeps them in a
# directory of their own.
cat > "$prefix/setup.bash" <<SETUP
# rmw_cyclonedds_cpp of $prefix (scripts/build_rmw_cyclonedds.sh), for the Python of $venv.
export LD_PRELOAD="$prefix/lib/librmw_cyclonedds_cpp.so\${LD_PRELOAD:+:\$LD_PRELOAD}"
export LD_LIBRARY_PATH="$plugins\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export RMW_IMPLEMENTATION=rmw_cyclonedds_cpp
SETUP
echo "$venv" > "$prefix/venv.txt" # test/test_security.py preloads it only into this venv's Python
"$python" -c "import rclpy" # the venv's rclpy imports
LD_PRELOAD="$prefix/lib/librmw_cyclonedds_cpp.so" "$python" -c \
    "import rclpy; from rclpy.utilities import get_rmw_implementation_identifier as i; rclpy.init(); print('rmw:', i())"
echo "source $prefix/setup.bash after $venv/bin/activate"
