VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PARTICIPANTS ?= 4

.PHONY: venv demo test test-fast test-slow synth lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[participant,local,infra,dev]'
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p reports
	$(VENV)/bin/fed demo --participants $(PARTICIPANTS) --report reports/demo.json

test: $(STAMP)
	$(PY) -m pytest -q -m "not chaos" tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m chaos tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) cdk.out reports
