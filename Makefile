# moed - persistent fused NVFP4 MoE decode engine.
#
#   make            build moed, moectl, libmoedclient (CUDA when nvcc is found)
#   make run        start moed on a built-in tiny synthetic model
#   make test       C unit tests + daemon/socket tests + Python checks (CI)
#   make asan       the same tests with host code under ASan + UBSan
#   make test-gpu   GPU correctness tests (needs an NVIDIA GPU)
#   make test-integration  SGLang / vLLM plugin tests in .venv-integ (downloads GBs)
#   make bench      GPU benchmark table (needs an NVIDIA GPU)
#   make fuzz       build libFuzzer targets (clang)
#   make fuzz-run   run each fuzz target FUZZ_RUNS times (CI: a short pass)
#   make soak       DURATION=30m mixed-load soak on the CPU backend (not in CI)
#   make install    PREFIX=/usr/local DESTDIR=  (unit, sysusers entry, example config too)
#   make deb        Debian package of the build (PREFIX=/usr)
#
# Knobs (override on the command line):
CC         ?= gcc
CUDA_HOME  ?= /usr/local/cuda
NVCC       ?= $(CUDA_HOME)/bin/nvcc
# CUDA=1 forces the CUDA backend, CUDA=0 a CPU-only build; default: detect nvcc.
CUDA       ?= $(shell test -x $(NVCC) && echo 1 || echo 0)
# Machine code built for each arch: sm_90a (H100/H200), sm_120a (RTX PRO 6000).
CUDA_ARCHS ?= 90a 120a
BUILD      ?= build
DEBUG      ?= 0
SANITIZE   ?= 0
PREFIX     ?= /usr/local
DESTDIR    ?=
SYSCONFDIR  ?= $(if $(filter /usr,$(PREFIX)),/etc,$(if $(filter /usr/local,$(PREFIX)),/etc,$(PREFIX)/etc))
UNITDIR     ?= $(if $(filter /usr,$(PREFIX)),/lib/systemd/system,$(PREFIX)/lib/systemd/system)
SYSUSERSDIR ?= $(if $(filter /usr,$(PREFIX)),/usr/lib/sysusers.d,$(PREFIX)/lib/sysusers.d)
PYTHON     ?= python3
VENV       ?= .venv

VERSION := 0.1.0

WARN := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
        -Wformat=2 -Wno-format-nonliteral -Wvla -Wpointer-arith
INCS := -Icommon -Ikernels -Iengine -Iipc -Iconfig -Istatus -Itools/moectl
PKGS := libuv libcjson libsystemd
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_CFLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS   := $(shell pkg-config --libs check 2>/dev/null)

OPT := -O2
ifeq ($(DEBUG),1)
OPT := -O0
endif
SAN :=
ifeq ($(SANITIZE),1)
SAN := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
endif

CFLAGS  ?=
CFLAGS  += -std=c11 -D_GNU_SOURCE -DMOED_VERSION='"$(VERSION)"' $(OPT) -g -fPIC -pthread \
           $(WARN) $(INCS) $(PKG_CFLAGS) $(SAN)
LDFLAGS ?=
LDFLAGS += -pthread $(SAN)
LIBS    := $(PKG_LIBS) -lm

# Host sources of libmoed.a, one folder per module (common/ config/ kernels/
# engine/ ipc/ status/); the daemon's main is daemon/, moectl is tools/moectl/
# (neither in the library). Files named *_cuda.c are built only with CUDA,
# *_nocuda.c only without.
DAEMON_C := $(wildcard daemon/*.c)
MAINS    := $(DAEMON_C)
ALL_C    := $(wildcard common/*.c config/*.c kernels/*.c engine/*.c ipc/*.c status/*.c)
LIB_C    := $(filter-out $(MAINS),$(ALL_C))
# moectl links the client library's objects and libmoedref.a (checkpoint
# loader, synthetic generator, CPU reference): no libuv server, no CUDA.
MOECTL_C := $(wildcard tools/moectl/*.c)
MOECTL_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(MOECTL_C))
REF_C    := common/moed_log.c common/moed_file.c engine/model.c engine/model_config.c engine/genmodel.c engine/safetensors.c \
            engine/placement.c kernels/moe_ref.c kernels/nvfp4.c
REF_OBJ  := $(patsubst %.c,$(BUILD)/%.o,$(REF_C))
MOECTL_LIBS := $(shell pkg-config --libs libcjson 2>/dev/null) -lm
ifeq ($(CUDA),1)
LIB_C    := $(filter-out %_nocuda.c,$(LIB_C))
CFLAGS   += -DMOED_HAVE_CUDA=1 -DMOED_CUDA_ARCHS='"$(CUDA_ARCHS)"' -I$(CUDA_HOME)/include
CU_SRC   := $(wildcard kernels/*.cu)
CU_OBJ   := $(patsubst %.cu,$(BUILD)/%.o,$(CU_SRC))
# The doorbell client kernel: a fatbin of its own (every CUDA_ARCHS SASS and
# compute_90 PTX for later GPUs), embedded in the daemon, sent to clients.
CHAN_FATBIN := $(BUILD)/kernels/moe_chan_client.fatbin
# The measurement probes (bench/probe: tile_probe includes the kernel's task
# code), compiled by check-cuda-compile so that a kernel change cannot leave
# them behind; they are built and run on the GPU machine
PROBE_OBJ := $(patsubst %.cu,$(BUILD)/%.o,$(wildcard bench/probe/*.cu))
LIBS     += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lnccl -lstdc++
else
LIB_C    := $(filter-out %_cuda.c,$(LIB_C))
CU_OBJ   :=
endif
LIB_OBJ  := $(patsubst %.c,$(BUILD)/%.o,$(LIB_C))
CLIENT_C := ipc/client.c ipc/client_desc.c ipc/client_chan.c ipc/client_gpu.c ipc/proto.c common/moed_err.c
CLIENT_OBJ := $(patsubst %.c,$(BUILD)/client/%.o,$(CLIENT_C))

NVCCFLAGS ?=
NVCCFLAGS += -std=c++17 -O3 -lineinfo -Xcompiler -fPIC -Werror all-warnings \
             $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
             $(INCS) -DMOED_HAVE_CUDA=1

UNIT_SRC := $(wildcard tests/unit/test_*.c)
UNIT_BIN := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
GPU_SRC  := $(wildcard tests/gpu/*.c)
GPU_BIN  := $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu_%,$(GPU_SRC))
TOOL_SRC := $(wildcard tests/tools/*.c)
TOOL_BIN := $(patsubst tests/tools/%.c,$(BUILD)/tools/%,$(TOOL_SRC))
BENCH_SRC := $(wildcard bench/*.c)
BENCH_BIN := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))
# bench-only CUDA sources (baselines) and libraries (cuBLAS): never in libmoed
BENCH_CU_OBJ := $(patsubst %.cu,$(BUILD)/%.o,$(wildcard bench/*.cu))
BENCH_LIBS ?= -L$(CUDA_HOME)/lib64 -lcublas
# bench-only host code shared by the bench programs (bench/lib: NVML energy)
BENCH_LIB_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(wildcard bench/lib/*.c))
.SECONDARY: $(BENCH_LIB_OBJ)

.PHONY: all run test unit-test py-test asan test-gpu test-integration bench bench-ep fuzz fuzz-run soak install deb clean \
        venv config-doc check-cuda-compile FORCE
all: $(BUILD)/moed $(BUILD)/moectl $(BUILD)/libmoedclient.so $(BUILD)/moed-client.pc \
     $(BUILD)/moed.service

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/client/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fvisibility=hidden -DMOEDC_BUILD -MMD -MP -c $< -o $@

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

ifeq ($(CUDA),1)
$(CHAN_FATBIN): kernels/chan_client/moe_chan_client.cu kernels/moe_gpu_abi.h
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O3 -fatbin -Werror all-warnings \
	    $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
	    -gencode=arch=compute_90,code=compute_90 -Ikernels $< -o $@
$(BUILD)/kernels/moe_chan_fatbin_cuda.o: CFLAGS += -DMOE_CHAN_FATBIN='"$(CHAN_FATBIN)"'
$(BUILD)/kernels/moe_chan_fatbin_cuda.o: $(CHAN_FATBIN)
endif

$(BUILD)/libmoed.a: $(LIB_OBJ) $(CU_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libmoedref.a: $(REF_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/moed: $(patsubst %.c,$(BUILD)/%.o,$(DAEMON_C)) $(BUILD)/libmoed.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

# (relinked when the Makefile changes: its libraries are named here)
$(BUILD)/moectl: $(MOECTL_OBJ) $(CLIENT_OBJ) $(BUILD)/libmoedref.a Makefile
	$(CC) $(LDFLAGS) -o $@ $(filter-out Makefile,$^) $(MOECTL_LIBS)

# Only the moedc_* API is exported (version script); `nm -D` shows it.
$(BUILD)/libmoedclient.so: $(CLIENT_OBJ) ipc/libmoedclient.map
	$(CC) $(LDFLAGS) -shared -Wl,-soname,libmoedclient.so.1 \
	  -Wl,--version-script=ipc/libmoedclient.map -o $@ $(CLIENT_OBJ) -ldl

# Files that name PREFIX are rebuilt when it changes: they depend on a stamp
# that holds its value (rewritten only when it differs).
$(BUILD)/prefix.stamp: FORCE
	@mkdir -p $(dir $@)
	@echo '$(PREFIX) $(SYSCONFDIR)' | cmp -s - $@ || echo '$(PREFIX) $(SYSCONFDIR)' > $@

$(BUILD)/moed-client.pc: ipc/moed-client.pc.in $(BUILD)/prefix.stamp
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

$(BUILD)/moed.service: scripts/moed.service $(BUILD)/prefix.stamp
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' $< > $@

FORCE:

$(BUILD)/tests/%: tests/unit/%.c $(BUILD)/libmoed.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(CHECK_CFLAGS) -Itests -o $@ $< $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS) $(CHECK_LIBS)

# bench/lib/power.h against a fake NVML built beside it (no driver in CI)
$(BUILD)/tests/libfake_nvml.so: tests/unit/fake_nvml.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE $(WARN) -O1 -shared -fPIC -o $@ $<
$(BUILD)/tests/libfake_nvml_partial.so: tests/unit/fake_nvml.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE $(WARN) -O1 -shared -fPIC -DFAKE_NVML_PARTIAL -o $@ $<
$(BUILD)/tests/libfake_nvml_old.so: tests/unit/fake_nvml.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE $(WARN) -O1 -shared -fPIC -DFAKE_NVML_OLD -o $@ $<
$(BUILD)/tests/test_power: tests/unit/test_power.c $(BENCH_LIB_OBJ) $(BUILD)/tests/libfake_nvml.so \
                           $(BUILD)/tests/libfake_nvml_partial.so $(BUILD)/tests/libfake_nvml_old.so
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(CHECK_CFLAGS) -Itests -Ibench/lib -o $@ $< $(BENCH_LIB_OBJ) $(LDFLAGS) \
	    $(LIBS) $(CHECK_LIBS)

$(BUILD)/tools/%: tests/tools/%.c $(BUILD)/libmoed.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS)

$(BUILD)/tests/gpu_%: tests/gpu/%.c $(BUILD)/libmoed.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -MMD -MP -o $@ $< $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS)

$(BUILD)/bench/%: bench/%.c $(BUILD)/libmoed.a $(BENCH_CU_OBJ) $(BENCH_LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -Ibench/lib -o $@ $< $(BENCH_CU_OBJ) $(BENCH_LIB_OBJ) $(BUILD)/libmoed.a \
	    $(LDFLAGS) $(LIBS) $(BENCH_LIBS)

# Python virtual environment for the test helpers (numpy, ml_dtypes,
# safetensors, pytest, prometheus_client, torch, transformers). The package
# index is asked only when tests/requirements.txt changes, and pip keeps no
# cache of what it fetched (torch's wheels are ~3 GB: with a cache a fresh
# venv takes twice that on disk); the client package (ipc/python) is
# reinstalled from the tree, offline, when its files change.
venv: $(VENV)/.stamp $(VENV)/.client-stamp
$(VENV)/.stamp: tests/requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir -r tests/requirements.txt
	touch $@
$(VENV)/.client-stamp: $(VENV)/.stamp ipc/python/pyproject.toml $(wildcard ipc/python/*.md ipc/python/moed_client/*)
	$(VENV)/bin/pip install -q --no-deps --no-index --no-build-isolation ./ipc/python
	touch $@

run: all
	$(BUILD)/moed --config config/example.json

test: all $(UNIT_BIN) $(TOOL_BIN) venv
	BUILD=$(BUILD) VENV=$(VENV) MOED_SANITIZE=$(SANITIZE) \
	  MOED_MAKE_ARGS="BUILD=$(BUILD) CUDA=$(CUDA) SANITIZE=$(SANITIZE) DEBUG=$(DEBUG)" \
	  scripts/run-tests.sh

asan:
	$(MAKE) BUILD=build-asan SANITIZE=1 CUDA=0 DEBUG=1 test

# SGLang / vLLM plugin tests against the real framework packages, in their
# own venv (.venv-integ, several GB; not part of `make test`).
test-integration: all
	BUILD=$(BUILD) PYTHON=$(PYTHON) scripts/test-integration.sh

test-gpu: all $(GPU_BIN) $(TOOL_BIN) venv
	BUILD=$(BUILD) VENV=$(VENV) scripts/run-gpu-tests.sh

bench: all $(BENCH_BIN)
	BUILD=$(BUILD) scripts/run-bench.sh

# One DeepSeek-V3 layer on one GPU and over BENCH_EP_GPUS (default 0,1), side
# by side (scripts/bench-ep.sh; docs/MULTI_GPU.md)
bench-ep: all
	BUILD=$(BUILD) scripts/bench-ep.sh

# The CUDA sources compile for every arch in CUDA_ARCHS (CI has nvcc, no GPU).
check-cuda-compile: $(CU_OBJ) $(CHAN_FATBIN) $(PROBE_OBJ)

# libFuzzer targets (clang): the host library built once with the fuzzer's
# coverage and ASan/UBSan, then one binary per tests/fuzz/fuzz_*.c.
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(FUZZ_SRC))
FUZZ_LIB_OBJ := $(patsubst %.c,$(BUILD)/fuzz/obj/%.o,$(filter-out %_cuda.c,$(filter-out $(MAINS),$(ALL_C))))
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE -DMOED_VERSION='"$(VERSION)"' -g -O1 \
               -fsanitize=fuzzer-no-link,address,undefined $(INCS) $(PKG_CFLAGS)
FUZZ_RUNS ?= 100000
fuzz: $(FUZZ_BIN)
.SECONDARY: $(FUZZ_LIB_OBJ)

$(BUILD)/fuzz/obj/%.o: %.c
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/fuzz/%: tests/fuzz/%.c $(FUZZ_LIB_OBJ)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $< $(FUZZ_LIB_OBJ) $(PKG_LIBS) -lm

# Every target for FUZZ_RUNS executions (CI: 100k each); FUZZ_TARGETS="a b" picks.
fuzz-run: fuzz
	BUILD=$(BUILD) RUNS=$(FUZZ_RUNS) tests/fuzz/run.sh $(FUZZ_TARGETS)

# Mixed load (restarts, kill -9, slow readers) against a CPU-backend daemon;
# prints p99 / RSS / fd drift from start to end (tests/soak/soak.py).
DURATION ?= 30m
soak: all venv
	$(VENV)/bin/python tests/soak/soak.py --duration $(DURATION) --build $(BUILD)

config-doc: $(BUILD)/moed
	$(BUILD)/moed --config-reference > config/README.md

# Layout under $(DESTDIR)$(PREFIX): bin/moed, bin/moectl, lib/libmoedclient.so.1
# (+ .so link), include/moed/*.h, lib/pkgconfig/moed-client.pc,
# share/doc/moed/; the systemd unit, its sysusers.d entry and an example
# config go to $(UNITDIR), $(SYSUSERSDIR) and $(SYSCONFDIR)/moed (an existing
# moed.json is kept). The library's directory must be known to the dynamic
# linker: /usr/local/lib and /usr/lib are (run `ldconfig` after installing
# there as root); for another PREFIX see README (ld.so.conf.d or rpath).
install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include/moed \
	           $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/share/doc/moed \
	           $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(SYSCONFDIR)/moed
	install -m 755 $(BUILD)/moed $(BUILD)/moectl $(DESTDIR)$(PREFIX)/bin/
	install -m 755 $(BUILD)/libmoedclient.so $(DESTDIR)$(PREFIX)/lib/libmoedclient.so.1
	ln -sf libmoedclient.so.1 $(DESTDIR)$(PREFIX)/lib/libmoedclient.so
	install -m 644 ipc/moed_client.h ipc/moed_proto.h common/moed_err.h \
	  $(DESTDIR)$(PREFIX)/include/moed/
	install -m 644 $(BUILD)/moed-client.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/
	install -m 644 $(BUILD)/moed.service $(DESTDIR)$(UNITDIR)/moed.service
	install -m 644 scripts/moed.sysusers $(DESTDIR)$(SYSUSERSDIR)/moed.conf
	install -m 644 config/moed.json $(DESTDIR)$(SYSCONFDIR)/moed/moed.json.example
	test -e $(DESTDIR)$(SYSCONFDIR)/moed/moed.json || \
	  install -m 644 config/moed.json $(DESTDIR)$(SYSCONFDIR)/moed/moed.json
	install -m 644 README.md $(DESTDIR)$(PREFIX)/share/doc/moed/README.md
	install -m 644 config/README.md $(DESTDIR)$(PREFIX)/share/doc/moed/config.md

# A Debian package of this build (PREFIX=/usr): `make deb` -> $(BUILD)/moed_$(VERSION)_ARCH.deb.
# postinst creates the moed user (systemd-sysusers) and reloads systemd; the
# unit is not enabled (systemctl enable --now moed). A CUDA build also needs
# the CUDA runtime it was linked against (not a Debian dependency).
DEB_ARCH = $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
DEB_ROOT = $(BUILD)/deb/root
deb:
	rm -rf $(BUILD)/deb
	$(MAKE) install PREFIX=/usr DESTDIR=$(abspath $(DEB_ROOT))
	mkdir -p $(DEB_ROOT)/DEBIAN
	mv $(DEB_ROOT)/etc/moed/moed.json.example $(DEB_ROOT)/usr/share/doc/moed/
	printf '%s\n' 'Package: moed' 'Version: $(VERSION)' 'Architecture: $(DEB_ARCH)' \
	  'Maintainer: moed developers <moed@localhost>' 'Section: misc' 'Priority: optional' \
	  'Depends: libc6, libuv1, libcjson1, libsystemd0' \
	  'Description: persistent fused Mixture-of-Experts decode daemon' \
	  ' moed serves the MoE layers of an LLM (NVFP4 experts) over a Unix socket;' \
	  ' with moectl, the C client library (libmoedclient) and a hardened systemd unit.' \
	  > $(DEB_ROOT)/DEBIAN/control
	echo /etc/moed/moed.json > $(DEB_ROOT)/DEBIAN/conffiles
	printf '%s\n' '#!/bin/sh' 'set -e' 'if [ "$$1" = configure ]; then' \
	  '  systemd-sysusers moed.conf || true' '  ldconfig' \
	  '  [ -d /run/systemd/system ] && systemctl daemon-reload || true' 'fi' \
	  > $(DEB_ROOT)/DEBIAN/postinst
	chmod 755 $(DEB_ROOT)/DEBIAN/postinst
	dpkg-deb --root-owner-group --build $(DEB_ROOT) $(BUILD)/moed_$(VERSION)_$(DEB_ARCH).deb

clean:
	rm -rf build build-asan

-include $(shell find $(BUILD) -name '*.d' -type f 2>/dev/null)
