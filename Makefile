# stasis — build, demo, test. Every target installs what it needs first, and
# installing twice changes nothing.

GO          ?= go
## PYTHON runs the Python client's tests: Debian's, whose pip, setuptools
## and wheel (deps-python) install the client offline.
PYTHON      ?= /usr/bin/python3
BIN         := bin/stasis
## Tools built or downloaded for the build and the tests live in a cache
## outside the work tree, one directory per version, so a fresh clone on the
## same machine reuses them; .tools/npm, .tools/microvm/kernel and
## .tools/image/debian are links into it.
CACHE       ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/stasis
STATICCHECK_VERSION := v0.8.2
TOOLS       := $(CACHE)/go/staticcheck-$(STATICCHECK_VERSION)
STATICCHECK := $(TOOLS)/staticcheck
## Versity Gateway, the S3 server the blob store's tests run against
## (internal/s3test), built with go install into the cache.
VERSITYGW_VERSION := v1.8.0
VERSITYGW_DIR     := $(CACHE)/go/versitygw-$(VERSITYGW_VERSION)
VERSITYGW         := $(VERSITYGW_DIR)/versitygw
VERSION     := $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS     := -X stasis/internal/insandbox/sandboxcli.version=$(VERSION)
export PATH := $(TOOLS):$(VERSITYGW_DIR):$(PATH)

.PHONY: all build demo demo-nodes test deps deps-python deps-test deps-s3 npm-prefix deps-opencode deps-clients deps-microvm deps-image vet staticcheck unit model python-client fuzz soak soak-sequences soak-cycles bench clean matrix

all: build

## deps: system packages the build and the tests use (gcc for cgo and -race,
## util-linux for setsid, nsenter and setpriv, bubblewrap for local
## sandboxes, tar; git, python3 and nodejs for the built-in tasks and the
## SWE-bench loader; spin for the protocol's model; postgresql, whose
## server the record store's tests start as an unprivileged user in a
## temporary directory); installed with apt-get only when missing.
deps:
	@missing=""; \
	command -v gcc >/dev/null 2>&1 || missing="$$missing gcc libc6-dev"; \
	command -v setsid >/dev/null 2>&1 || missing="$$missing util-linux"; \
	command -v nsenter >/dev/null 2>&1 || missing="$$missing util-linux"; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v tar >/dev/null 2>&1 || missing="$$missing tar"; \
	command -v curl >/dev/null 2>&1 || missing="$$missing curl"; \
	command -v git >/dev/null 2>&1 || missing="$$missing git"; \
	[ -x /usr/bin/python3 ] || missing="$$missing python3"; \
	[ -x /usr/bin/node ] || command -v node >/dev/null 2>&1 || missing="$$missing nodejs"; \
	command -v spin >/dev/null 2>&1 || missing="$$missing spin"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(STATICCHECK):
	@echo "installing staticcheck $(STATICCHECK_VERSION) into $(TOOLS)"
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

## deps-opencode: OpenCode (npm package opencode-ai, pinned) for the harness
## tests, in .tools/npm, with the same version of @opencode-ai/plugin, which
## OpenCode would otherwise try to install into its config directory at run
## time (internal/insandbox/harness/opencode links it there). npm runs only when either is
## missing or at another version; the check runs OpenCode with a throwaway
## home, and the install (whose script runs OpenCode) with its XDG
## directories in .tools/npm, so nothing lands in ~ (npm keeps HOME for its
## own config).
OPENCODE_VERSION   := 1.18.33
OPENAI_SDK_VERSION := 6.49.0
CODEX_VERSION      := 0.171.0
NPM_PREFIX       := $(CURDIR)/.tools/npm
NPM_CACHE        := $(CACHE)/npm/opencode-$(OPENCODE_VERSION)+openai-$(OPENAI_SDK_VERSION)+codex-$(CODEX_VERSION)
OPENCODE         := $(NPM_PREFIX)/node_modules/.bin/opencode
OPENCODE_PROBE   := env -u XDG_DATA_HOME -u XDG_CONFIG_HOME -u XDG_CACHE_HOME -u XDG_STATE_HOME HOME=$(NPM_PREFIX)/.probe-home $(OPENCODE)
OPENCODE_PLUGIN_JSON := $(NPM_PREFIX)/node_modules/@opencode-ai/plugin/package.json

## npm-prefix: .tools/npm is a link to the npm cache directory of these
## versions (a directory left there by an older checkout is replaced).
npm-prefix:
	@mkdir -p $(NPM_CACHE) $(CURDIR)/.tools; \
	if [ "$$(readlink $(NPM_PREFIX))" != "$(NPM_CACHE)" ]; then rm -rf $(NPM_PREFIX) && ln -s $(NPM_CACHE) $(NPM_PREFIX); fi

deps-opencode: npm-prefix
	@if [ "$$($(OPENCODE_PROBE) --version 2>/dev/null)" = "$(OPENCODE_VERSION)" ] && \
	   grep -q '"version": *"$(OPENCODE_VERSION)"' $(OPENCODE_PLUGIN_JSON) 2>/dev/null; then :; else \
		command -v npm >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; }; \
		echo "installing opencode-ai $(OPENCODE_VERSION) into $(NPM_PREFIX)"; \
		mkdir -p $(NPM_PREFIX) && \
		XDG_DATA_HOME=$(NPM_PREFIX)/.probe-home/.local/share XDG_CONFIG_HOME=$(NPM_PREFIX)/.probe-home/.config \
		XDG_CACHE_HOME=$(NPM_PREFIX)/.probe-home/.cache XDG_STATE_HOME=$(NPM_PREFIX)/.probe-home/.local/state \
		npm install --prefix $(NPM_PREFIX) --save-exact --no-audit --no-fund \
			opencode-ai@$(OPENCODE_VERSION) @opencode-ai/plugin@$(OPENCODE_VERSION) || exit 1; \
		got="$$($(OPENCODE_PROBE) --version 2>&1)"; \
		if [ "$$got" != "$(OPENCODE_VERSION)" ]; then \
			echo "$(OPENCODE) --version printed '$$got', want $(OPENCODE_VERSION): the opencode-linux-* binary package did not install; rm -rf $(NPM_PREFIX) and run make deps-opencode again" >&2; \
			exit 1; \
		fi; \
	fi

## deps-clients: third-party OpenAI clients the relay's tests drive: the
## official openai npm SDK (6.x: 7.x needs Node.js 22, and the machines
## we run on have 20) and the Codex CLI (@openai/codex, whose npm
## package carries its native binary), pinned, in .tools/npm beside
## OpenCode. npm runs only when either is missing or at another version;
## after the install everything runs offline. The version check runs Codex
## with a throwaway home, so nothing lands in ~.
CODEX              := $(NPM_PREFIX)/node_modules/.bin/codex

deps-clients: npm-prefix
	@if grep -q '"version": *"$(OPENAI_SDK_VERSION)"' $(NPM_PREFIX)/node_modules/openai/package.json 2>/dev/null && \
	   grep -q '"version": *"$(CODEX_VERSION)"' $(NPM_PREFIX)/node_modules/@openai/codex/package.json 2>/dev/null && \
	   [ -x $(CODEX) ]; then :; else \
		command -v npm >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm; }; \
		echo "installing openai $(OPENAI_SDK_VERSION) and @openai/codex $(CODEX_VERSION) into $(NPM_PREFIX)"; \
		mkdir -p $(NPM_PREFIX) && \
		npm install --prefix $(NPM_PREFIX) --save-exact --no-audit --no-fund \
			openai@$(OPENAI_SDK_VERSION) @openai/codex@$(CODEX_VERSION) || exit 1; \
		got="$$(mkdir -p $(NPM_PREFIX)/.probe-home/.codex && HOME=$(NPM_PREFIX)/.probe-home CODEX_HOME=$(NPM_PREFIX)/.probe-home/.codex $(CODEX) --version 2>&1)"; \
		case "$$got" in *$(CODEX_VERSION)*) ;; *) echo "$(CODEX) --version printed '$$got', want $(CODEX_VERSION): its native package did not install; rm -rf $(NPM_PREFIX)/node_modules/@openai and run make deps-clients again" >&2; exit 1;; esac; \
	fi

## deps-microvm: what the microVM provider needs: QEMU (qemu-system-x86),
## a static busybox (busybox-static) and mkfs.erofs (erofs-utils: a guest's
## image root as a block image) from apt-get, and the Debian cloud
## kernel, whose package (linux-image-cloud-amd64's current kernel) is
## downloaded with apt-get and unpacked into the cache (one directory per
## kernel package; .tools/microvm/kernel links to it), not installed on the
## host. apt-cache names the package; without package lists the newest
## kernel in the cache is taken before asking apt-get update. The tests and
## `stasis` find it through STASIS_MICROVM_KERNEL, exported here.
MICROVM_KERNEL := $(CURDIR)/.tools/microvm/kernel
export STASIS_MICROVM_KERNEL := $(MICROVM_KERNEL)

deps-microvm:
	@missing=""; \
	command -v qemu-system-x86_64 >/dev/null 2>&1 || missing="$$missing qemu-system-x86"; \
	dpkg-query -W -f='$${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || missing="$$missing busybox-static"; \
	command -v mkfs.erofs >/dev/null 2>&1 || missing="$$missing erofs-utils"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@if ! ls $(MICROVM_KERNEL)/boot/vmlinuz-*-cloud-amd64 >/dev/null 2>&1; then \
		pkg=$$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $$2; exit}'); \
		if [ -z "$$pkg" ]; then pkg=$$(ls -d $(CACHE)/microvm/linux-image-*/boot 2>/dev/null | xargs -r -n1 dirname | xargs -r -n1 basename | sort -V | tail -1); fi; \
		if [ -z "$$pkg" ]; then apt-get update -qq; pkg=$$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/{print $$2; exit}'); fi; \
		[ -n "$$pkg" ] || { echo "no linux-image-cloud-amd64 package found by apt-cache" >&2; exit 1; }; \
		dir=$(CACHE)/microvm/$$pkg; \
		if ! ls $$dir/boot/vmlinuz-*-cloud-amd64 >/dev/null 2>&1; then \
			echo "downloading and unpacking $$pkg into $$dir"; \
			dl=$$(mktemp -d) && chmod 755 $$dl && \
			(cd $$dl && apt-get download -qq "$$pkg" 2>&1 | grep -v 'unsandboxed' || true) && \
			rm -rf $$dir.tmp && mkdir -p $$dir.tmp && \
			dpkg-deb -x $$dl/$${pkg}_*.deb $$dir.tmp && rm -rf $$dl && \
			rm -rf $$dir && mv $$dir.tmp $$dir || exit 1; \
		fi; \
		mkdir -p $(dir $(MICROVM_KERNEL)) && rm -rf $(MICROVM_KERNEL) && ln -s $$dir $(MICROVM_KERNEL) || exit 1; \
	fi

## deps-python: Debian's Python packages that SWE-bench environments are
## built from (internal/control/task/pyenv: a venv over Debian's dist-packages, the
## repository installed in development mode with pip and setuptools), and
## pytest for the tests' instances; installed with apt-get only when missing.
PYTHON_DEBS = python3-venv python3-pip python3-setuptools python3-wheel python3-pytest python3-attr
deps-python:
	@missing=""; \
	for p in $(PYTHON_DEBS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

## deps-image: the Debian image the tests and the demo run sandboxes on:
## mmdebstrap (a Debian package, installed when missing) makes a minbase
## root file system of IMAGE_SUITE with IMAGE_PACKAGES from this machine's
## own apt sources, and `stasis image import` turns it into an OCI image
## layout in the cache, one directory per suite and package list (so it is
## rebuilt only when those change); .tools/image/debian links to it, and
## STASIS_TEST_IMAGE names it.
IMAGE_SUITE    := bookworm
IMAGE_PACKAGES := python3,python3-pytest,nodejs,golang-go,git,ca-certificates
IMAGE_KEY      := $(shell printf '%s\n' '$(IMAGE_SUITE)' '$(IMAGE_PACKAGES)' minbase | sha256sum | cut -c1-16)
IMAGE_DIR      := $(CACHE)/image/debian-$(IMAGE_SUITE)-$(IMAGE_KEY)
IMAGE_LINK     := $(CURDIR)/.tools/image/debian
APT_SOURCES    := $(firstword $(wildcard /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list))
export STASIS_TEST_IMAGE := oci:$(IMAGE_LINK):stasis

deps-image: build
	@if [ ! -f $(IMAGE_DIR)/index.json ]; then \
		command -v mmdebstrap >/dev/null 2>&1 || { echo "installing: mmdebstrap"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap; }; \
		[ -n "$(APT_SOURCES)" ] || { echo "no apt sources on this machine (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list)" >&2; exit 1; }; \
		echo "building the Debian image ($(IMAGE_SUITE): $(IMAGE_PACKAGES)) into $(IMAGE_DIR)"; \
		tmp=$$(mktemp -d) && \
		mmdebstrap --quiet --variant=minbase --include=$(IMAGE_PACKAGES) $(IMAGE_SUITE) $$tmp/rootfs.tar $(APT_SOURCES) && \
		rm -rf $(IMAGE_DIR).tmp && \
		./$(BIN) image import $$tmp/rootfs.tar --layout $(IMAGE_DIR).tmp --tag stasis \
			--env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 && \
		rm -rf $$tmp $(IMAGE_DIR) && mv $(IMAGE_DIR).tmp $(IMAGE_DIR) || { rm -rf $$tmp; exit 1; }; \
	fi
	@if [ "$$(readlink $(IMAGE_LINK))" != "$(IMAGE_DIR)" ]; then mkdir -p $(dir $(IMAGE_LINK)) && rm -rf $(IMAGE_LINK) && ln -s $(IMAGE_DIR) $(IMAGE_LINK); fi

## deps-s3: Versity Gateway (an S3 server, posix backend) for the S3 blob
## store's tests; building it takes minutes the first time.
deps-s3: $(VERSITYGW)

$(VERSITYGW):
	@echo "building Versity Gateway $(VERSITYGW_VERSION) into $(VERSITYGW_DIR) (minutes, once)"
	@mkdir -p $(VERSITYGW_DIR)
	GOBIN=$(VERSITYGW_DIR) $(GO) install github.com/versity/versitygw/cmd/versitygw@$(VERSITYGW_VERSION)

deps-test: deps deps-python $(STATICCHECK) deps-opencode deps-clients deps-microvm deps-image deps-s3

## build: bin/stasis, the host's command line, and bin/stasis-sandbox, the lean
## build placed in every sandbox (supervisor, relay, ctl, mini, guest agent;
## no task data), found beside bin/stasis.
build: deps
	CGO_ENABLED=0 $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/stasis
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w $(LDFLAGS)" -o $(BIN)-sandbox ./cmd/stasis-sandbox

## demo: the main job: 8 episodes (mini and OpenCode alternating) on the
## built-in tasks, in sandboxes on the Debian image (deps-image), a
## checkpoint mid-way, a crash of everything, the restore, and the report.
demo: build deps-opencode deps-image
	./$(BIN) run --episodes 8 --harness mixed --crash --image $(STASIS_TEST_IMAGE)

## demo-nodes: the demo across three `stasis serve --node` processes on
## this machine (scripts/demo-nodes): a throwaway PostgreSQL and S3 server,
## a checkpoint over the nodes, every node killed, two back, and the third
## node's episodes restored onto them; everything removed at the end.
demo-nodes: build deps-s3
	scripts/demo-nodes

vet:
	$(GO) vet ./...

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...

## unit: every package's tests under the race detector but the whole-run
## tests of RACE_FREE, which run beside them without it: each runs whole
## `stasis run` jobs whose processes (servers, supervisors, relays,
## harnesses) are that test binary, three times slower when built for
## -race, and whose code is race-tested in its own packages.
RACE_FREE := stasis/internal/control/job
unit:
	@log=$$(mktemp); pkgs=$$($(GO) list ./... | grep -vxF '$(RACE_FREE)'); \
	echo "go test -count=1 -timeout 45m $(RACE_FREE) (beside the rest, its output after theirs)"; \
	$(GO) test -count=1 -timeout 45m $(RACE_FREE) >$$log 2>&1 & job=$$!; \
	rc=0; $(GO) test -race -count=1 -timeout 45m $$pkgs || rc=$$?; \
	wait $$job || rc=$$?; cat $$log; rm -f $$log; exit $$rc

## model: only the check of the checkpoint protocol's model
## (internal/control/coordinator/protocol.pml) with spin; `unit` runs it too.
model: deps
	$(GO) test -count=1 -run TestProtocolModel -v ./internal/control/coordinator

## python-client: the Python client's tests (clients/python) and the
## rollout-loop example, against real `stasis serve` processes of bin/stasis.
python-client: build deps-python
	STASIS_BIN=$(CURDIR)/$(BIN) $(PYTHON) -m unittest discover -s clients/python/tests

## test: vet, staticcheck, the whole Go suite under the race detector, and
## the Python client's tests.
test: deps-test vet staticcheck unit python-client

## matrix: the whole kill matrix (RELIABILITY.md, internal/killmatrix):
## the local and node cells, which `unit` runs too, and the microVM cells,
## which it skips (each boots and saves guests under TCG). UPDATE=1 writes
## the tables the cells found to internal/killmatrix/testdata, to be put in
## RELIABILITY.md.
matrix: deps-microvm deps-s3 deps
	STASIS_KILL_MATRIX_MICROVM=1 $(GO) test -race -count=1 -timeout 40m -v ./internal/killmatrix $(if $(UPDATE),-update)

## fuzz: run every fuzz target of the tree (each `func Fuzz…` in a _test.go
## file, found afresh each run) for FUZZTIME each (default 30s), one after
## another, and stop at the first failure. A failing input lands in its
## package's testdata/fuzz (commit it: it is then a seed the unit tests
## run). After each target, scripts/fuzz-keep copies the corpus the fuzzer
## grew for it in Go's cache (`go env GOCACHE`/fuzz, which a clean clone
## and CI do not have) into the package's testdata/fuzz/FuzzName, so it is
## kept in the repository (commit it) and `go test` runs it as seeds:
## entries not already there, smallest first, while the directory holds
## fewer than FUZZKEEP (default 200) files, none over 64 KiB; nothing there
## is removed. FUZZ=Name runs only the targets whose name matches.
FUZZTIME ?= 30s
FUZZ     ?= .
FUZZKEEP ?= 200
fuzz: deps
	@set -e; n=0; \
	for f in $$(grep -rl --include='*_test.go' '^func Fuzz' . | sort); do \
		dir=./$$(dirname $${f#./}); \
		for name in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f | grep -E '$(FUZZ)'); do \
			echo "== $$dir $$name ($(FUZZTIME))"; \
			rc=0; $(GO) test $$dir -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 10s || rc=$$?; \
			GO=$(GO) scripts/fuzz-keep $$dir $$name $(FUZZKEEP); \
			[ $$rc = 0 ] || exit $$rc; \
			n=$$((n+1)); \
		done; \
	done; \
	echo "fuzz: $$n targets ran for $(FUZZTIME) each, none failed"

## soak: the long reliability runs (not part of `make test`), one after
## another, each bounded in count and in time, so it stops by itself:
##  - soak-sequences: random trainer sequences (internal/control/trainer),
##    SEEDS of them (default 1000), seeds SEED_FIRST, SEED_FIRST+1, ...,
##    starting no new one once SOAK_TIME (default 5h: a seed takes 5 to
##    20 s on two quiet cores, so a thousand take two to four hours) has
##    passed; one sequence is bounded too (15 minutes). `make test` runs four. A
##    failing seed prints its number, how to replay it (-seed N) and its
##    sequence; the run goes on to the next.
##  - soak-cycles: CYCLES checkpoint/restore cycles (default 100) of
##    CYCLE_EPISODES episodes (64) kept live through them, on one `stasis
##    serve` on its embedded store and on a cluster of 3 nodes on
##    PostgreSQL and S3, and MICROVM_CYCLES (10) of MICROVM_EPISODES (4) on
##    the microVM provider (four guests of 1 GiB: without KVM each is a
##    TCG process that wants a core); each run starts no new cycle after CYCLE_TIME
##    (default 2h). Every cycle's resources (each node's RSS, open
##    descriptors, goroutines, store and blob-store bytes after the
##    previous checkpoint is deleted and collected) are appended as JSON
##    lines to $(SOAK_OUT)/cycles-*.jsonl; a run fails if descriptors or
##    goroutines grow from its first cycles to its last.
## RELIABILITY.md records the runs.
SEEDS            ?= 1000
SEED_FIRST       ?= 1
SOAK_TIME        ?= 5h
CYCLES           ?= 100
CYCLE_EPISODES   ?= 64
CYCLE_TIME       ?= 2h
MICROVM_CYCLES   ?= 10
MICROVM_EPISODES ?= 4
SOAK_OUT         ?= $(CURDIR)/.soak
soak: soak-sequences soak-cycles

soak-sequences: deps deps-s3
	$(GO) test ./internal/control/trainer -run '^TestRandomSequences$$' -count=1 -timeout 0 -v \
		-args -seeds $(SEEDS) -first $(SEED_FIRST) -soak-time $(SOAK_TIME)

soak-cycles: deps deps-s3 deps-microvm
	mkdir -p $(SOAK_OUT)
	$(GO) test ./internal/control/trainer -run '^TestSoakCycles$$' -count=1 -timeout 0 -v \
		-args -cycles $(CYCLES) -cycle-episodes $(CYCLE_EPISODES) -cycle-nodes 1 -cycle-time $(CYCLE_TIME) \
		-cycle-report $(SOAK_OUT)/cycles-local-1.jsonl
	$(GO) test ./internal/control/trainer -run '^TestSoakCycles$$' -count=1 -timeout 0 -v \
		-args -cycles $(CYCLES) -cycle-episodes $(CYCLE_EPISODES) -cycle-nodes 3 -cycle-time $(CYCLE_TIME) \
		-cycle-report $(SOAK_OUT)/cycles-local-3.jsonl
	$(GO) test ./internal/control/trainer -run '^TestSoakCycles$$' -count=1 -timeout 0 -v \
		-args -cycles $(MICROVM_CYCLES) -cycle-episodes $(MICROVM_EPISODES) -cycle-nodes 1 -cycle-provider microvm \
		-cycle-time $(CYCLE_TIME) -cycle-report $(SOAK_OUT)/cycles-microvm-1.jsonl

## bench: the figures BENCHMARKS.md records.
bench: build deps-microvm
	./$(BIN) bench supervise
	./$(BIN) bench snapshot
	./$(BIN) bench sandbox
	./$(BIN) bench checkpoint
	./$(BIN) bench microvm
	$(GO) test ./internal/control/bench -run '^$$' -bench . -benchtime 200x

## clean: the build and the links in .tools; the cache ($(CACHE)) stays.
clean:
	rm -rf bin .tools
