# `make demo` and `make test` work on a fresh clone: they create .venv and install first.
# `make demo` runs `fusionai demo`: a broker and four providers on this machine, one dying mid-answer.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-slow test-lab test-fidelity lint demo bench chaos constraints clean browser dist

# torch first, pinned: the CPU wheel is local; an unpinned torch pulls several GB of CUDA.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[torch,dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Two workers (pytest-xdist): real-process tests spend much of their time waiting on their
# children, which the other worker's tests fill. (Default scheduling: with `--dist loadfile` or
# `loadgroup`, xdist silently drops the fuzz tests' schemathesis cases, which share one test id.)
XDIST := -n 2

test: lint browser
	$(PY) -m pytest $(XDIST) -m "not slow and not lab and not fidelity" --durations=12

# The dashboard test needs Debian's Chromium: installed here when we can (root with apt-get);
# elsewhere that test is skipped, except under CI=true where it fails.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -q --no-install-recommends chromium >/dev/null \
		|| echo "note: Chromium is not installed; the dashboard test will be skipped"; }

# (one process: these are mostly busy, and one compares its pace under load with its own)
test-slow: $(STAMP)
	$(PY) -m pytest $(XDIST) -m slow --durations=12

# The home-internet lab (network namespaces, NAT routers, shaped links): needs root,
# iproute2, iptables, nftables and miniupnpd (`.ci/run` installs them on Debian).
test-lab: $(STAMP)
	$(PY) -m pytest -m lab --durations=12

# The simulator's predictions of four lab scenarios against the lab, three runs each (root;
# 13 minutes here): `benchmarks/fidelity.py` and its bounds. Not a `.ci/run` part yet: after
# five passes in a row on one machine, a machine of the same kind ran the lab 5 to 10 %
# slower than predicted wherever CPU or latency limits it, and one of its three runs failed
# the median bound (README); the cause is not found.
test-fidelity: $(STAMP)
	$(PY) -m pytest -m fidelity --durations=12

# A broker and 5 providers, 100 mixed jobs, providers killed and frozen, one broker restart:
# prints a JSON summary; fails unless every job succeeded with single-process output.
chaos: $(STAMP)
	$(PY) -m tests.chaos --seed 1 --jobs 100

demo: $(STAMP)
	$(VENV)/bin/fusionai demo

bench: $(STAMP)
	$(PY) benchmarks/transport.py
	$(PY) benchmarks/ir_split.py
	$(PY) benchmarks/placement.py
	$(PY) benchmarks/simulator.py
	$(PY) benchmarks/provider_hop.py
	$(PY) benchmarks/broker_service.py
	$(PY) benchmarks/http_api.py
	$(PY) benchmarks/e2e.py
	$(PY) benchmarks/concurrency.py
	$(PY) benchmarks/kv_cache.py
	$(PY) benchmarks/sampling.py
	$(PY) benchmarks/gateways.py
	$(PY) benchmarks/finetune.py
	$(PY) benchmarks/pretrain.py
	$(PY) benchmarks/models.py
	$(PY) benchmarks/quantized.py
	$(PY) benchmarks/verify.py
	$(PY) benchmarks/internet.py  # the home-internet lab: needs root, else says why it skipped
	$(PY) benchmarks/fidelity.py  # the lab again (root): predicted against measured

# Re-pin every installed package after changing dependencies.
constraints: $(STAMP)
	{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v -i -E '^(torch|fusionai)=='; } > constraints.new
	mv constraints.new constraints.txt

# One wheel per onnxruntime build (fusionai, fusionai-cuda, fusionai-directml) into dist/.
dist: $(STAMP)
	$(PY) release/variants.py wheel cpu
	$(PY) release/variants.py wheel cuda
	$(PY) release/variants.py wheel directml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info dist
