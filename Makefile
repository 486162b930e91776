# moed - persistent fused NVFP4 MoE decode engine.
#
#   make            build moed, moectl, libmoedclient (CUDA when nvcc is found)
#   make run        start moed on a built-in tiny synthetic model
#   make test       C unit tests + daemon/socket tests + Python checks (CI)
#   make asan       the same tests with host code under ASan + UBSan
#   make test-gpu   GPU correctness tests (needs an NVIDIA GPU)
#   make bench      GPU benchmark table (needs an NVIDIA GPU)
#   make fuzz       build libFuzzer targets (clang)
#   make fuzz-run   run each fuzz target FUZZ_RUNS times (CI: a short pass)
#   make soak       DURATION=30m mixed-load soak on the CPU backend (not in CI)
#   make install    PREFIX=/usr/local DESTDIR=
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
PYTHON     ?= python3
VENV       ?= .venv

VERSION := 0.1.0

WARN := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
        -Wformat=2 -Wno-format-nonliteral -Wvla -Wpointer-arith
INCS := -Icommon -Ikernels -Iengine -Iipc -Iconfig
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

# Host sources: every .c under these dirs except program mains. Files named
# *_cuda.c are built only with CUDA, *_nocuda.c only without.
MAINS    := engine/moed_main.c engine/moectl.c
ALL_C    := $(wildcard common/*.c config/*.c kernels/*.c engine/*.c ipc/*.c)
LIB_C    := $(filter-out $(MAINS),$(ALL_C))
ifeq ($(CUDA),1)
LIB_C    := $(filter-out %_nocuda.c,$(LIB_C))
CFLAGS   += -DMOED_HAVE_CUDA=1 -I$(CUDA_HOME)/include
CU_SRC   := $(wildcard kernels/*.cu)
CU_OBJ   := $(patsubst %.cu,$(BUILD)/%.o,$(CU_SRC))
LIBS     += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lnccl -lstdc++
else
LIB_C    := $(filter-out %_cuda.c,$(LIB_C))
CU_OBJ   :=
endif
LIB_OBJ  := $(patsubst %.c,$(BUILD)/%.o,$(LIB_C))
CLIENT_C := ipc/client.c ipc/proto.c common/moed_err.c
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

.PHONY: all run test unit-test py-test asan test-gpu bench fuzz fuzz-run soak install clean \
        venv config-doc check-cuda-compile
all: $(BUILD)/moed $(BUILD)/moectl $(BUILD)/libmoedclient.so $(BUILD)/moed-client.pc

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/client/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fvisibility=hidden -DMOEDC_BUILD -MMD -MP -c $< -o $@

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libmoed.a: $(LIB_OBJ) $(CU_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/moed: $(BUILD)/engine/moed_main.o $(BUILD)/libmoed.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/moectl: $(BUILD)/engine/moectl.o $(BUILD)/libmoed.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/libmoedclient.so: $(CLIENT_OBJ)
	$(CC) $(LDFLAGS) -shared -Wl,-soname,libmoedclient.so.1 -o $@ $^

$(BUILD)/moed-client.pc: ipc/moed-client.pc.in
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

$(BUILD)/tests/%: tests/unit/%.c $(BUILD)/libmoed.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(CHECK_CFLAGS) -Itests -o $@ $< $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS) $(CHECK_LIBS)

$(BUILD)/tools/%: tests/tools/%.c $(BUILD)/libmoed.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS)

$(BUILD)/tests/gpu_%: tests/gpu/%.c $(BUILD)/libmoed.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS)

$(BUILD)/bench/%: bench/%.c $(BUILD)/libmoed.a $(BENCH_CU_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(BENCH_CU_OBJ) $(BUILD)/libmoed.a $(LDFLAGS) $(LIBS) $(BENCH_LIBS)

# Python virtual environment for the test helpers (numpy, ml_dtypes, safetensors).
venv: $(VENV)/.stamp
$(VENV)/.stamp: tests/requirements.txt $(wildcard ipc/python/moed_client/*.py)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r tests/requirements.txt
	$(VENV)/bin/pip install -q ./ipc/python
	touch $@

run: all
	$(BUILD)/moed --config config/example.json

test: all $(UNIT_BIN) $(TOOL_BIN) venv
	BUILD=$(BUILD) VENV=$(VENV) MOED_SANITIZE=$(SANITIZE) scripts/run-tests.sh

asan:
	$(MAKE) BUILD=build-asan SANITIZE=1 CUDA=0 DEBUG=1 test

test-gpu: all $(GPU_BIN) $(TOOL_BIN) venv
	BUILD=$(BUILD) VENV=$(VENV) scripts/run-gpu-tests.sh

bench: all $(BENCH_BIN)
	BUILD=$(BUILD) scripts/run-bench.sh

# The CUDA sources compile for every arch in CUDA_ARCHS (CI has nvcc, no GPU).
check-cuda-compile: $(CU_OBJ)

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

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include \
	           $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 755 $(BUILD)/moed $(BUILD)/moectl $(DESTDIR)$(PREFIX)/bin/
	install -m 755 $(BUILD)/libmoedclient.so $(DESTDIR)$(PREFIX)/lib/libmoedclient.so.1
	ln -sf libmoedclient.so.1 $(DESTDIR)$(PREFIX)/lib/libmoedclient.so
	install -m 644 ipc/moed_client.h ipc/moed_proto.h common/moed_err.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(BUILD)/moed-client.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/

clean:
	rm -rf build build-asan

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
