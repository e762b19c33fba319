# hora's build: a virtualenv in .venv, set up once and reused.
#   make setup   create .venv and install hora (editable) with its pytorch, test, mpi, nccl-cu12 and secure extras
#   make setup-frameworks   add TensorFlow, Keras 3, JAX (flax, optax) to .venv (what the suite needs)
#   make setup-mxnet        .venv-mxnet: MXNet 1.9.1 needs numpy<1.24, so it gets its own virtualenv
#   make test    run the test suite (PYTEST_ARGS='-k ring' to pass arguments to pytest; the MXNet part
#                runs in .venv-mxnet, and only when PYTEST_ARGS is empty); as root on Debian it first
#                installs the system packages the suite uses (deps-system), so no test skips for want of them
#   make demo    train on scikit-learn's digits with 2 ranks through `hora run`
#   make lint    ruff
#   make sz      code lines per module under hora/; fails past 400 in any module
#   make bench   benchmarks/allreduce.py (and train.py): tables and plots in benchmarks/results/
#                (BENCH_ARGS=--quick for a short run)
#   make deps-system   (root, Debian) the system packages later features need: ssh, ip, Open MPI

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Written once setup succeeded; setup reruns only when pyproject.toml (or this file) is newer.
STAMP := $(VENV)/.hora-setup-stamp
# torch==2.13.0 is pinned first because that CPU build lies on this kind of machine's disk;
# letting pip resolve plain `torch` instead would download a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# hora[secure] (wire_protection, tests/test_wire_protection.py): the version the suite and benchmarks/README.md ran
SECURE_PIN := cryptography==50.0.2
# The framework stack the suite tests against, pinned to what resolves together on Python 3.11
# (jax 0.12 needs Python >= 3.12; tensorflow-cpu 2.21's tf.keras is Keras 3). hora's extras stay open.
FRAMEWORK_PINS := tensorflow-cpu==2.21.0 keras==3.15.1 jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8
# hora.spark's tests: PySpark 4 (needs Java 17/21: openjdk-17-jre-headless in SYSTEM_PACKAGES)
FRAMEWORK_PINS += pyspark==4.3.0
# hora.spark's Estimators read Parquet with pyarrow (pandas 2: PySpark 4.3 warns on pandas 3); hora.lightning: Lightning 2.x
FRAMEWORK_PINS += pyarrow==26.0.1 pandas==2.3.3 pytorch-lightning==2.6.6
FW_STAMP := $(VENV)/.hora-frameworks-stamp
# Keras 2 for TF_USE_LEGACY_KERAS=1 (hora.keras's tf_keras path), pinned to TensorFlow's minor. Installed with
# --no-deps: tf-keras requires the `tensorflow` distribution, which would install a second copy of the same
# files beside tensorflow-cpu.
TF_KERAS_PIN := tf-keras==2.21.0
MXVENV := .venv-mxnet
MXPY := $(MXVENV)/bin/python
MX_STAMP := $(MXVENV)/.hora-setup-stamp
MXNET_PINS := numpy<1.24 mxnet==1.9.1
PYTEST_ARGS ?=
BENCH_ARGS ?=
SYSTEM_PACKAGES := iproute2 openssh-server openssh-client openmpi-bin libopenmpi-dev openjdk-17-jre-headless

.PHONY: setup setup-frameworks setup-mxnet test demo lint sz deps-system clean bench
# hora.ray's tests: Ray (2.60.0 adds packages to the stack above and changes none of its versions)
FRAMEWORK_PINS += ray==2.60.0

# The stamp alone is not enough: an editable install records the package layout it saw (hora was once a
# namespace without __init__.py) and the checkout's path (a .venv copied along with a moved tree). So setup
# also checks that the venv imports hora from this checkout (-I: not via the current directory), and
# reinstalls when it does not. Costs one interpreter start (no import) when all is well.
setup:
	@$(PY) -I -c 'import importlib.util as u, sys; sys.exit(u.find_spec("hora").origin != sys.argv[1])' \
		'$(CURDIR)/hora/__init__.py' >/dev/null 2>&1 || rm -f $(STAMP)
	@$(MAKE) --no-print-directory -q $(STAMP) || $(MAKE) --no-print-directory $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[pytorch,test,mpi,nccl-cu12,secure,plot]' $(SECURE_PIN)
	touch $@

setup-frameworks: setup $(FW_STAMP)

$(FW_STAMP): $(STAMP)
	$(PIP) install -q $(TORCH_PIN) $(FRAMEWORK_PINS)
	$(PIP) install -q --no-deps $(TF_KERAS_PIN)
	touch $@

# hora without torch: its core on NumPy 1.23, and the mxnet binding (the same checkout check as setup's)
setup-mxnet:
	@$(MXPY) -I -c 'import importlib.util as u, sys; sys.exit(u.find_spec("hora").origin != sys.argv[1])' \
		'$(CURDIR)/hora/__init__.py' >/dev/null 2>&1 || rm -f $(MX_STAMP)
	@$(MAKE) --no-print-directory -q $(MX_STAMP) || $(MAKE) --no-print-directory $(MX_STAMP)

$(MX_STAMP): pyproject.toml Makefile
	test -x $(MXPY) || $(PYTHON) -m venv $(MXVENV)
	$(MXPY) -m pip install -q '$(word 1,$(MXNET_PINS))' $(word 2,$(MXNET_PINS))
	$(MXPY) -m pip install -q -e '.[test]' '$(word 1,$(MXNET_PINS))'
	touch $@

# tests/mxnet_suite.txt lists the test files that run in .venv-mxnet (the mxnet binding, and the core
# on NumPy 1.23); in .venv those skip themselves where mxnet is missing.
# deps-system first: mpi4py (installed by setup) loads the Open MPI it installs; not root: it says so and skips
test: deps-system setup-frameworks $(if $(PYTEST_ARGS),,setup-mxnet)
	$(PY) -m pytest -q --durations=15 $(if $(PYTEST_ARGS),$(PYTEST_ARGS),tests)
	$(if $(PYTEST_ARGS),,$(MXPY) -m pytest -q --durations=10 -p no:cacheprovider $$(cat tests/mxnet_suite.txt))

demo: setup
	$(VENV)/bin/hora run -np 2 $(PY) examples/pytorch/train_digits.py

lint: setup
	$(VENV)/bin/ruff check .

sz:
	$(PYTHON) tools/sz.py

# matplotlib only draws the plots, so it is installed here rather than in an extra
bench: setup
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PIP) install -q matplotlib
	$(PY) benchmarks/allreduce.py $(BENCH_ARGS)
	@if [ -f benchmarks/train.py ]; then $(PY) benchmarks/train.py $(BENCH_ARGS); fi

# Idempotent: installs only what is missing, so it costs a dpkg query when all is there.
# Open MPI refuses to run as root unless OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set;
# mpi4py (the `mpi` extra, installed by setup) loads this Open MPI; run deps-system before setup.
deps-system:
	@if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "deps-system: not root or no apt-get; skipping ($(SYSTEM_PACKAGES))"; exit 0; fi; \
	missing=""; for p in $(SYSTEM_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then echo "deps-system: all installed"; exit 0; fi; \
	echo "deps-system: installing$$missing"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing

clean:
	rm -rf $(VENV) $(MXVENV) build *.egg-info
