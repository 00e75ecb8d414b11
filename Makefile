VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
PARTICIPANTS ?= 4
DEMO_ARGS ?=  # e.g. make demo DEMO_ARGS=--mixed-speeds

.PHONY: venv demo test test-slow test-load bench bench-big bench-hf bench-learning bench-lm-outer bench-rounds bench-cold synth lint clean

venv: $(STAMP)

# The CDK command line and the IAM evaluator the access check runs (package-lock.json pins both).
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[participant,datasets,local,infra,dev]'
	touch $(STAMP)

demo: $(STAMP) $(NODE_STAMP)
	mkdir -p reports
	$(VENV)/bin/fed demo --participants $(PARTICIPANTS) --report reports/demo.json --plot reports/demo.png $(DEMO_ARGS)

# Everything but the long fault-injection and flood tests (those are `make test-slow`; CI runs both). Every AWS call
# the tests make is judged against the roles `cdk synth` creates (tests/conftest.py, local/access); the report of
# what each role is granted and which test used it goes to reports/access.md.
test: $(STAMP) $(NODE_STAMP)
	mkdir -p reports
	$(PY) -m pytest -q -m "not chaos and not slow" --access-report reports/access.md tests

# The chaos, flood and attack tests, and the load test at 200 participants in 60 s rounds (about 4 minutes): the
# requests a participant-round costs in a round of a minute. CI runs it; the thousand is `make test-load`.
test-slow: $(STAMP) $(NODE_STAMP)
	$(PY) -m pytest -q -s -m "chaos or slow" --ignore=tests/e2e/test_load.py tests
	LOAD_PARTICIPANTS=200 LOAD_STAGGER=30 LOAD_LIVENESS=180 $(PY) -m pytest -q -s -m slow tests/e2e/test_load.py

# The load test at its defaults: 1,000 simulated participants, 3 rounds (tests/e2e/test_load.py), about 11 minutes
# on this 2-core machine with nothing else running (five minutes of joining, then rounds of ~100 s). Run on purpose:
# it needs the whole machine, so CI (`.ci/run`, about 36 minutes in all) runs the 200 of `make test-slow` instead.
test-load: $(STAMP) $(NODE_STAMP)
	$(PY) -m pytest -q -s -m slow tests/e2e/test_load.py

# Synthesize the stack (offline, no AWS credentials) with cdk-nag's AwsSolutions checks; a finding fails it.
# `make synth CONFIG=runs/<name>.toml` for another run file (default: cdk.json's runs/example.toml).
synth: $(STAMP) $(NODE_STAMP)
	JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION=20 npx --no-install cdk synth --quiet $(if $(CONFIG),-c config=$(CONFIG))

# The benchmarks time the system, not the access check (the local server judging each call): it is off for them.

# Aggregation from files: the piece-wise path (K=1, K=2) vs Flower's algorithm and numpy, GB/s and peak memory, one run.
bench: $(STAMP)
	FED_ACCESS_CHECK=off $(PY) benchmarks/aggregation.py

# Server optimizers, data modes and compressed updates, each row a real `fed demo` run: one table (digits and the LM);
# then DiLoCo by update encoding (fp32, int8, topk, Streaming DiLoCo F = 4) on the LM and tiny HF tasks at the same
# tokens: bytes up and down per outer step and peak per sync from the participants' logs, against issue 45's targets.
# `make bench-learning LEARNING_ARGS="--only encodings"` for that part alone (2 participants x 16 outer steps of 5 inner).
bench-learning: $(STAMP)
	FED_ACCESS_CHECK=off $(PY) benchmarks/learning.py $(LEARNING_ARGS)

# The LM task's rounds simulated in process (no stack): FedAvg vs DiLoCo's outer rule over a grid of settings.
# The Hugging Face task inside a participant against the same loop bare (tokens/s, transfers); --size 0.5b on a GPU.
bench-hf: $(STAMP)
	FED_ACCESS_CHECK=off $(PY) benchmarks/hf_participant.py

bench-lm-outer: $(STAMP)
	FED_ACCESS_CHECK=off $(PY) benchmarks/lm_outer.py

# The whole loop with a ~1 GB update (fp32, then the same parameters in bf16), K = 1 and 2 shards: per-round
# transfer, ingest and aggregation times, the data-movement limit measured beside them, peak memory per process.
bench-big: $(STAMP)
	FED_ACCESS_CHECK=off $(PY) benchmarks/big_loop.py

# The Flower anchor's exact work through `fed demo --task flower` (4 participants, each its own shard, 15 rounds):
# each round's accuracy and seconds; the start-up and a round step by step; AWS requests per round by caller; CPU
# per round by process; each figure beside Flower's and the last recorded (benchmarks/rounds_recorded.json) as
# ratios. Exits 1 if the run fails or the accuracy is not 0.9289.
bench-rounds: $(STAMP)
	mkdir -p reports
	FED_ACCESS_CHECK=off $(PY) benchmarks/rounds.py --out reports/bench-rounds.json

# Cold starts: each Lambda handler's import, `fed --help` and `fed-participant --help`, 5 fresh processes each, beside
# `python -c pass` and against the targets (0.5 s, 1 s); the heaviest handler's costliest packages (-X importtime).
bench-cold: $(STAMP)
	FED_ACCESS_CHECK=off $(PY) benchmarks/cold_imports.py

# ruff, mypy (strict on the core) and the layer contracts in pyproject.toml (import-linter).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) cdk.out reports build
