#!/usr/bin/env bash
# Install ROS 2's launch front end (launch, launch_xml, launch_yaml, launch_ros, ros2launch) and the
# operator's ros2 commands (ros2cli: node, param, topic, service, lifecycle, pkg, run) from their
# sources into a Python venv that holds the ROS 2 wheels of requirements-ros.txt, with colcon, for
# machines without a ROS distro. None of these is on PyPI. On the car the distro provides them all:
# never run this there.
#
#   scripts/install_launch_stack.sh VENV SOURCES
#
# SOURCES holds the sources of one distro, unpacked side by side: launch/ (ros2/launch),
# launch_ros/ (ros2/launch_ros), ros2cli/ (ros2/ros2cli), rosidl_runtime_py/ (ros2/rosidl_runtime_py,
# which ros2 topic and ros2 service import) and rcl_interfaces/ (ros2/rcl_interfaces, for
# composition_interfaces, which launch_ros imports), e.g. each with
# `git archive jazzy | tar -x -C SOURCES/<name>`. Nothing of them goes into this repository.
# composition_interfaces is an interface package: it is built with plain cmake into the venv, as
# scripts/build_interfaces.sh builds pacmod3_msgs.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 VENV SOURCES" >&2
    exit 2
fi
prefix="$(cd "$1" && pwd)"
sources="$(cd "$2" && pwd)"
python="$prefix/bin/python"
if [[ ! -x "$python" ]]; then
    echo "$0: no Python at $python" >&2
    exit 2
fi

# The Python dependencies the launch and ros2cli packages declare (package.xml exec_depend), as the
# distro's python3-* packages provide them, colcon, and wheel (the packages below are built without
# isolation, and a venv's setuptools before 70.1 has no bdist_wheel of its own).
"$python" -m pip install --quiet osrf-pycommon==2.0.2 psutil==7.2.2 argcomplete==3.7.2 colcon-common-extensions==0.3.0 wheel==0.45.1

packages=(
    rosidl_runtime_py
    launch/launch launch/launch_xml launch/launch_yaml
    launch_ros/launch_ros launch_ros/ros2launch
    ros2cli/ros2cli ros2cli/ros2node ros2cli/ros2service ros2cli/ros2param ros2cli/ros2topic
    ros2cli/ros2lifecycle ros2cli/ros2pkg ros2cli/ros2run
)
for package in "${packages[@]}"; do
    # ament_python packages: setup.py installs the module, its resource-index marker and share/.
    "$python" -m pip install --quiet --no-deps --no-build-isolation "$sources/$package"
done

# The wheels' exported *__rosidl_generator_py targets name include directories of the container
# they were built in; point them at this Python's once every target is known (deferred to the end
# of the configure step), as interfaces/pacmod3_msgs/CMakeLists.txt does for itself.
mkdir -p "$prefix/build/interfaces"
fix="$prefix/build/interfaces/fix_wheel_includes.cmake"
cat > "$fix" <<'CMAKE'
find_package(Python3 REQUIRED COMPONENTS Interpreter Development NumPy)
function(fix_wheel_includes)
  get_directory_property(imported_targets IMPORTED_TARGETS)
  foreach(target IN LISTS imported_targets)
    if(target MATCHES "__rosidl_generator_py$")
      get_target_property(include_dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
      foreach(dir IN LISTS include_dirs)
        if(NOT EXISTS "${dir}")
          set_target_properties(${target} PROPERTIES
            INTERFACE_INCLUDE_DIRECTORIES "${Python3_INCLUDE_DIRS};${Python3_NumPy_INCLUDE_DIRS}")
          break()
        endif()
      endforeach()
    endif()
  endforeach()
endfunction()
cmake_language(DEFER CALL fix_wheel_includes)
CMAKE
INTERFACES_CMAKE_ARGS="-DCMAKE_PROJECT_INCLUDE=$fix" \
    "$(dirname "$0")/build_interfaces.sh" "$prefix" "$sources/rcl_interfaces/composition_interfaces"
"$python" -c "import composition_interfaces.srv, launch_ros, ros2cli; print('launch stack installed:', launch_ros.__file__)"
# What sourcing a distro's setup.bash does for these packages: the ament index of the venv prefix,
# where `ros2 launch` and find-pkg-share look packages up (launch's own included).
cat > "$prefix/setup.bash" <<SETUP
# The launch stack of $prefix (scripts/install_launch_stack.sh): source it where a distro's
# /opt/ros/\$ROS_DISTRO/setup.bash would be, before the workspace's install/setup.bash.
export AMENT_PREFIX_PATH="$prefix\${AMENT_PREFIX_PATH:+:\$AMENT_PREFIX_PATH}"
SETUP
echo "source $prefix/setup.bash where a distro's setup.bash would be sourced"
