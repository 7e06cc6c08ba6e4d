# kvroute: nginx module, workers and tools.
#
#   make                 build everything into build/
#   make test            build, run every test, end with "N passed, N failed"
#   make test SANITIZE=1 the same under ASan+UBSan, built into build/san/
#   make run [PORT=8080] demo stack: nats-server, 4 mock workers, nginx
#   make run DISAGG=1    the same, disaggregated: 2 prefill + 2 decode mock workers
#   make bench           benchmarks (minutes); results go to docs/BENCHMARKS.md by hand
#   make bench-disagg    8 mock engines aggregated vs 4+4 and 2+6 prefill/decode (minutes)
#   make bench-scale     decision time vs fleet size, many nginx instances
#   make CUDA=0          skip the CUDA engine even where nvcc exists
#   make install         module, load snippet, kvworker and tools (DESTDIR, PREFIX; docs/INSTALL.md)
#   make deb             Debian packages into build/deb/ (debian/)
#
# Sources are found by globbing, so adding a file needs no edit here:
#   src/{core,text,index,events,route}/*.c -> build/lib/libkvcore.a (no nginx headers)
#   src/ngx/*.c         -> build/modules/ngx_http_kvroute_module.so (see ./config)
#   tools/trace/*.c     -> build/lib/libkvtrace.a (trace files and synthesis)
#   workers/*.c         -> build/bin/kvworker (main.c) + build/lib/libkvworker.a
#   workers/cuda/*.cu   -> build/lib/libkvcuda.so, loaded by kvworker --engine cuda
#   tools/<name>/*.c    -> build/bin/<name>
#   t/unit/test_*.c     -> build/t/test_*  (linked with both libraries)
#   t/fuzz/fuzz_*.c     -> build/fuzz/fuzz_* (clang libFuzzer, `make fuzz`), and
#                          build/t/test_fuzz_* (with t/fuzz/replay.c: seeds and
#                          fixed mutants of them, a unit test of `make test`)

SANITIZE ?= 0
CUDA     ?= $(if $(shell command -v nvcc 2>/dev/null),1,0)
NVCC     ?= nvcc
PORT     ?= 8080

ifeq ($(SANITIZE),1)
B        := build/san
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer \
            -fno-sanitize-recover=undefined
OPT      := -O1
else
B        := build
SANFLAGS :=
OPT      := -O2
endif

CC       ?= cc
CFLAGS   := -std=gnu11 $(OPT) -g -fPIC -pthread -Wall -Wextra -Werror \
            -Wno-unused-parameter -Wshadow -Wstrict-prototypes \
            -D_GNU_SOURCE -MMD -MP $(SANFLAGS) $(EXTRA_CFLAGS)
LDFLAGS  := -pthread $(SANFLAGS)
LIBS     := -levent -levent_pthreads -lnats -lzmq -ljansson -lxxhash -lutf8proc -ldl -lm
VENV     := .venv
PY       := $(VENV)/bin/python

# Layers, lowest first, and what each may include. Each is compiled with
# only its own include paths, so a file that reaches up or sideways does not
# build (docs/ARCHITECTURE.md):
#   src/core    (nothing)             hashing, UTF-8, JSON/msgpack, the event wire format
#   src/text    core                  tokenizer, chat templates
#   src/index   core                  prefix index, worker registry, load table
#   src/events  core index            NATS ingestion into the index
#   src/route   core text index       request body -> blocks, scoring, the decision
#   src/ngx     every src layer       the nginx glue (built by ./config)
#   workers     core text             kvworker
#   tools/trace core                  trace files and synthesis (kvbench, kvsynth)
#   tools/*, t/ everything
LAYERS      := core text index events route
USES_core   := core
USES_text   := core text
USES_index  := core index
USES_events := core index events
USES_route  := core text index route
ALL_INC     := $(LAYERS:%=-Isrc/%) -Iworkers -Itools/trace
$(foreach l,$(LAYERS),$(eval $(B)/obj/src/$(l)/%.o: INC := $(USES_$(l):%=-Isrc/%)))
$(B)/obj/workers/%.o:     INC := -Isrc/core -Isrc/text -Iworkers
$(B)/obj/tools/trace/%.o: INC := -Isrc/core -Itools/trace
$(B)/obj/tools/%.o:       INC := $(ALL_INC)

CORE_SRC   := $(foreach l,$(LAYERS),$(wildcard src/$(l)/*.c))
CORE_OBJ   := $(CORE_SRC:%.c=$(B)/obj/%.o)
TRACE_SRC  := $(wildcard tools/trace/*.c)
TRACE_OBJ  := $(TRACE_SRC:%.c=$(B)/obj/%.o)
WORK_SRC   := $(filter-out workers/main.c,$(wildcard workers/*.c))
WORK_OBJ   := $(WORK_SRC:%.c=$(B)/obj/%.o)
TOOL_NAMES := $(notdir $(patsubst %/,%,$(dir $(wildcard tools/*/main.c))))
TOOL_BINS  := $(TOOL_NAMES:%=$(B)/bin/%)
UNIT_SRC   := $(wildcard t/unit/test_*.c)
UNIT_BINS  := $(UNIT_SRC:t/unit/%.c=$(B)/t/%)
FUZZ_SRC   := $(wildcard t/fuzz/fuzz_*.c)
FUZZ_BINS  := $(FUZZ_SRC:t/fuzz/%.c=$(B)/fuzz/%)
FUZZ_TESTS := $(FUZZ_SRC:t/fuzz/%.c=$(B)/t/test_%)
CUDA_SRC   := $(wildcard workers/cuda/*.cu)
HEADERS    := $(foreach l,$(LAYERS),$(wildcard src/$(l)/*.h)) $(wildcard workers/*.h)

CORE_LIB   := $(B)/lib/libkvcore.a
TRACE_LIB  := $(B)/lib/libkvtrace.a
WORK_LIB   := $(B)/lib/libkvworker.a
MODULE     := $(B)/modules/ngx_http_kvroute_module.so
KVWORKER   := $(B)/bin/kvworker
ifeq ($(CUDA),1)
ifneq ($(CUDA_SRC),)
CUDA_LIB   := $(B)/lib/libkvcuda.so
endif
endif
# the CUDA engine on the host emulation of CUDA, wherever g++ exists (see below)
GXX        ?= $(shell command -v g++ 2>/dev/null)
ifneq ($(GXX),)
ifneq ($(CUDA_SRC),)
CUDA_EMU_LIB := $(B)/lib/libkvcuda-emu.so
CUDA_EMU_TEST := $(B)/t/test_kvemu
endif
endif

.PHONY: all deps core module bins test unit run bench bench-e2e bench-disagg bench-faults bench-scale bench-xfer fuzz clean install \
        uninstall deb gpu-check
.DEFAULT_GOAL := all

all: deps
	@$(MAKE) --no-print-directory build-all

build-all: $(CORE_LIB) $(TRACE_LIB) $(WORK_LIB) $(MODULE) $(KVWORKER) $(TOOL_BINS) $(CUDA_LIB) \
           $(CUDA_EMU_LIB) $(CUDA_EMU_TEST) $(UNIT_BINS) $(FUZZ_TESTS)

deps:
	@tools/install-deps

# --- libraries ------------------------------------------------------------
# Header dependencies come from -MMD (.d files beside the objects).

$(B)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INC) -c -o $@ $<

-include $(shell find $(B)/obj -name '*.d' 2>/dev/null)

$(CORE_LIB): $(CORE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(WORK_LIB): $(WORK_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(TRACE_LIB): $(TRACE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# --- nginx module ---------------------------------------------------------
# Debian's recipe (docs/BUILD.md): configure with the distribution's flags so
# the module is binary compatible with /usr/sbin/nginx, then build only the
# modules target. configure is slow (~6 s), so it reruns only when ./config
# or the flags change.
#
# ./config is self-contained (it compiles the src layers itself, for the
# standard `./configure --add-dynamic-module` route, docs/INSTALL.md); here
# KVROUTE_CORE_LIB hands it libkvcore.a instead, so the layers are compiled
# once, with this Makefile's stricter warnings, per-layer include paths and
# SANITIZE flags. tools/build-against-nginx and t/integration/test_install.py
# exercise the self-contained route.

NGX_SRC   := /usr/share/nginx/src
NGX_B     := $(abspath $(B)/ngx)
NGX_CC    := $(shell dpkg-buildflags --get CFLAGS 2>/dev/null) -fPIC \
             $(shell dpkg-buildflags --get CPPFLAGS 2>/dev/null) \
             -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
             -Wno-sign-compare $(SANFLAGS)
NGX_LD    := $(shell dpkg-buildflags --get LDFLAGS 2>/dev/null) -fPIC $(SANFLAGS)
NGX_SRCS  := $(wildcard src/ngx/*.c src/ngx/*.h)
NGX_LIST  := $(B)/ngx-sources

# ./config globs src/ngx/*.c when configure runs: re-run it when the list of
# files changes (the list file is rewritten only then).
$(shell mkdir -p $(B); echo $(NGX_SRCS) | cmp -s - $(NGX_LIST) 2>/dev/null \
        || echo $(NGX_SRCS) > $(NGX_LIST))

$(NGX_B)/Makefile: config $(NGX_LIST)
	@mkdir -p $(NGX_B)
	@echo "configuring nginx module build (once)"
	cd $(NGX_SRC) && KVROUTE_CORE_LIB=$(abspath $(CORE_LIB)) bash -c '. ./conf_flags; \
	    ./configure "$${NGX_CONF_FLAGS[@]}" \
	    --with-cc-opt="$(NGX_CC)" --with-ld-opt="$(NGX_LD)" \
	    --add-dynamic-module=$(CURDIR) --builddir=$(NGX_B)' > $(NGX_B)/configure.log 2>&1 \
	    || { tail -20 $(NGX_B)/configure.log; exit 1; }

$(MODULE): $(NGX_B)/Makefile $(NGX_SRCS) $(CORE_LIB) $(HEADERS)
	$(MAKE) --no-print-directory -f $(NGX_B)/Makefile -C $(NGX_SRC) modules
	@mkdir -p $(dir $@)
	@# a new inode: a running nginx keeps its mapping of the old file
	cp $(NGX_B)/ngx_http_kvroute_module.so $@.tmp && mv -f $@.tmp $@

module: deps
	@$(MAKE) --no-print-directory $(MODULE)

# --- workers and tools ----------------------------------------------------

$(KVWORKER): $(B)/obj/workers/main.o $(WORK_LIB) $(CORE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

# every .c in tools/<name>/ belongs to that tool
.SECONDEXPANSION:
# (no % inside: a pattern rule would substitute the stem into patsubst's pattern)
$(B)/bin/%: $$(addprefix $(B)/obj/,$$(subst .c,.o,$$(wildcard tools/$$*/*.c))) $(TRACE_LIB) $(WORK_LIB) $(CORE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(TRACE_LIB) $(WORK_LIB) $(CORE_LIB) $(LIBS)

# kvw_model.o and kvw_sample.o come from libkvworker.a (built -fPIC)
# The CUDA engine reuses the model loader and the sampler: their objects are
# built again without sanitizers (the .so is loaded by sanitized and plain
# binaries alike). PTX for compute_90 lets newer GPUs JIT the kernels; the
# rpath finds cuBLAS where nvcc's toolkit lives.
CUDA_HOST_OBJ := $(B)/obj/cuda-host/kvw_model.o $(B)/obj/cuda-host/kvw_sample.o
# make gpu-check builds with CUDA_GENCODE=-arch=native (only the local GPU)
CUDA_GENCODE  ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=sm_80 \
                 -gencode arch=compute_90,code=compute_90
CUDA_LIBDIR   := $(abspath $(dir $(shell command -v $(NVCC) 2>/dev/null))../lib64)

$(B)/obj/cuda-host/%.o: workers/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out $(SANFLAGS),$(CFLAGS)) -Isrc/core -Isrc/text -Iworkers -c -o $@ $<

$(B)/lib/libkvcuda.so: $(CUDA_SRC) $(wildcard workers/cuda/*.h workers/cuda/*.cuh) $(HEADERS) \
                       $(CUDA_HOST_OBJ)
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -Xcompiler -fPIC,-Wall -shared -Isrc/core -Isrc/text -Iworkers \
	    $(CUDA_GENCODE) -o $@ $(CUDA_SRC) $(CUDA_HOST_OBJ) -lcublas -ljansson -Xlinker -rpath=$(CUDA_LIBDIR)

# The same CUDA sources built a second time, for the host, against kvemu
# (workers/cuda/emu: the CUDA runtime and cuBLAS emulated on the CPU), always
# under ASan/UBSan, wherever g++ exists: libkvcuda-emu.so, loaded through
# KVW_CUDA_LIB=... by kvworker/kvengine (the sanitizer runtime preloaded).
# The CUDA tests run on it without a GPU; nvcc's build above is unchanged.
EMU_SAN      := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
EMU_HOST_OBJ := $(B)/obj/cuda-emu/kvw_model.o $(B)/obj/cuda-emu/kvw_sample.o

$(B)/obj/cuda-emu/%.o: workers/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out $(SANFLAGS),$(CFLAGS)) $(EMU_SAN) -Isrc/core -Isrc/text -Iworkers -c -o $@ $<

$(B)/lib/libkvcuda-emu.so: $(CUDA_SRC) $(wildcard workers/cuda/*.cuh workers/cuda/*.h workers/cuda/emu/*) \
                           $(HEADERS) $(EMU_HOST_OBJ)
	@mkdir -p $(dir $@)
	$(GXX) -std=c++17 -O1 -g -fPIC -shared -Wall -Wextra -Werror -Wno-unused-parameter \
	    -Wno-unknown-pragmas $(EMU_SAN) -Iworkers/cuda/emu -Isrc/core -Isrc/text -Iworkers \
	    -o $@ -x c++ $(CUDA_SRC) workers/cuda/emu/kvemu.cpp -x none $(EMU_HOST_OBJ) -ljansson

# kvemu's own tests (t/cudaemu): a unit test binary like t/unit's
$(B)/t/test_kvemu: t/cudaemu/test_kvemu.cu $(wildcard workers/cuda/emu/* workers/cuda/*.cuh \
                   workers/cuda/*.h) t/unit/kvtest.h $(B)/obj/cuda-emu/kvw_sample.o
	@mkdir -p $(dir $@)
	$(GXX) -std=c++17 -O1 -g -Wall -Wextra -Werror -Wno-unused-parameter -Wno-unknown-pragmas $(EMU_SAN) \
	    -Iworkers/cuda/emu -Iworkers/cuda -Iworkers -Isrc/core -It/unit -o $@ -x c++ $< \
	    workers/cuda/emu/kvemu.cpp -x none $(B)/obj/cuda-emu/kvw_sample.o

# One command on a machine with a GPU: builds for it (into $(B)/gpu), runs
# the CUDA tests, compares with the CPU engine, benchmarks, and writes
# $(B)/gpu-check.json (tools/gpu-check).
gpu-check: deps
	@tools/gpu-check --build $(B)

# --- tests ----------------------------------------------------------------

$(B)/t/%: t/unit/%.c t/unit/kvtest.h $(TRACE_LIB) $(WORK_LIB) $(CORE_LIB)
	@mkdir -p $(dir $@)
	@mkdir -p $(B)/obj/t
	$(CC) $(CFLAGS) -MF $(B)/obj/t/$*.d $(ALL_INC) -It/unit $(LDFLAGS) -o $@ $< $(TRACE_LIB) $(WORK_LIB) $(CORE_LIB) $(LIBS)

# Each fuzz target again, with the compiler and flags of the unit tests and
# t/fuzz/replay.c's main instead of libFuzzer's (no -MMD: two sources)
$(B)/t/test_fuzz_%: t/fuzz/fuzz_%.c t/fuzz/replay.c $(wildcard t/fuzz/*.h) $(HEADERS) \
                    $(WORK_LIB) $(CORE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -MMD -MP,$(CFLAGS)) -DFUZZ_TARGET='"fuzz_$*"' $(ALL_INC) $(LDFLAGS) \
	    -o $@ $< t/fuzz/replay.c $(WORK_LIB) $(CORE_LIB) $(LIBS)

unit: all
	@$(PY) t/run.py --build $(B) --unit-only

test: all
	@$(PY) t/run.py --build $(B) --sanitize $(SANITIZE)

# libFuzzer targets: clang only, always sanitized, separate objects.
FUZZ_CFLAGS := -std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined \
               -D_GNU_SOURCE $(ALL_INC) -Wall -Wextra -Werror -Wno-unused-parameter

# the workers' pure decoders fuzzed beside the core's (the KV transfer's wire format)
FUZZ_WORKER_SRC := workers/kvw_xfer_wire.c

$(B)/fuzz/%: t/fuzz/%.c $(wildcard t/fuzz/*.h) $(CORE_SRC) $(FUZZ_WORKER_SRC) $(HEADERS)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -o $@ $< $(CORE_SRC) $(FUZZ_WORKER_SRC) -lnats -lzmq -ljansson -lxxhash -lutf8proc -lm -lpthread

fuzz: deps $(FUZZ_BINS)
	@tools/fuzz-all $(B)/fuzz $(FUZZ_SECONDS)

# --- installing -----------------------------------------------------------
# What `make` built; nothing is rebuilt here with the dependency installer.
# The module goes where Debian's nginx looks (/usr/share/nginx/modules links
# to /usr/lib/nginx/modules) and is loaded by a modules-enabled snippet, as
# Debian's module packages do; kvworker and the tools go to PREFIX/bin, with
# libkvcuda.so (when built) in PREFIX/lib where kvworker looks for it.

PREFIX          ?= /usr/local
NGX_MODULES_DIR ?= /usr/lib/nginx/modules
NGX_CONF_DIR    ?= /etc/nginx
NGX_SNIPPET     := mod-http-kvroute.conf
NGX_AVAILABLE   := /usr/share/nginx/modules-available

bins: $(KVWORKER) $(TOOL_BINS)

# keep the tools' objects (intermediates of the rule above), so that
# `make install` after `make` relinks nothing
.SECONDARY: $(foreach t,$(TOOL_NAMES),$(patsubst %.c,$(B)/obj/%.o,$(wildcard tools/$(t)/*.c)))

install: $(MODULE) $(KVWORKER) $(TOOL_BINS)
	install -d $(DESTDIR)$(NGX_MODULES_DIR) $(DESTDIR)$(NGX_AVAILABLE) \
	    $(DESTDIR)$(NGX_CONF_DIR)/modules-enabled $(DESTDIR)$(PREFIX)/bin \
	    $(DESTDIR)$(PREFIX)/share/kvroute
	install -m 644 $(MODULE) $(DESTDIR)$(NGX_MODULES_DIR)/
	echo "load_module $(NGX_MODULES_DIR)/ngx_http_kvroute_module.so;" \
	    > $(DESTDIR)$(NGX_AVAILABLE)/$(NGX_SNIPPET)
	ln -sf $(NGX_AVAILABLE)/$(NGX_SNIPPET) \
	    $(DESTDIR)$(NGX_CONF_DIR)/modules-enabled/50-$(NGX_SNIPPET)
	install -m 755 $(KVWORKER) $(TOOL_BINS) $(DESTDIR)$(PREFIX)/bin/
	$(if $(wildcard $(B)/lib/libkvcuda.so),install -D -m 644 $(B)/lib/libkvcuda.so \
	    $(DESTDIR)$(PREFIX)/lib/libkvcuda.so)
	cp -r conf/tokenizers conf/templates $(DESTDIR)$(PREFIX)/share/kvroute/

uninstall:
	rm -f $(DESTDIR)$(NGX_MODULES_DIR)/ngx_http_kvroute_module.so \
	    $(DESTDIR)$(NGX_AVAILABLE)/$(NGX_SNIPPET) \
	    $(DESTDIR)$(NGX_CONF_DIR)/modules-enabled/50-$(NGX_SNIPPET) \
	    $(DESTDIR)$(PREFIX)/bin/kvworker $(TOOL_NAMES:%=$(DESTDIR)$(PREFIX)/bin/%) \
	    $(DESTDIR)$(PREFIX)/lib/libkvcuda.so
	rm -rf $(DESTDIR)$(PREFIX)/share/kvroute

# Debian packages (debian/), built from a copy of the sources so that the
# tree and build/ stay as they are; the .debs land in build/deb/. Needs
# debhelper and dpkg-dev, which `make` does not install (dpkg-buildpackage
# names what is missing).
DEB_DIR := build/deb

deb:
	rm -rf $(DEB_DIR) && mkdir -p $(DEB_DIR)/src
	tar -c --exclude=./build --exclude=./.venv --exclude=./.git . | tar -x -C $(DEB_DIR)/src
	cd $(DEB_DIR)/src && dpkg-buildpackage -b -us -uc > ../build.log 2>&1 \
	    || { tail -40 ../build.log; exit 1; }
	@ls $(DEB_DIR)/*.deb

# --- running --------------------------------------------------------------

run: all
	@tools/demo --build $(B) --port $(PORT) $(if $(filter-out 0,$(DISAGG)),--disagg)

bench: all
	@tools/bench-all --build $(B)

bench-faults: all
	@.venv/bin/python tools/bench-faults

# decision time at 8..4,096 servers, 1..8 nginx instances, convergence
bench-scale: all
	@tools/bench-scale --build $(B)

# the KV transfer between two CPU-engine kvworkers on loopback (docs/BENCHMARKS.md)
bench-xfer: all
	@$(PY) tools/kvxfer-bench --build $(B) $(if $(COMPARE),--compare $(COMPARE))

# SUITE=1: the workload suite (docs/BENCHMARKS.md "Workload suite"), SUITE_RUNS=N repeats it,
# SEED=N generates its traces from another seed
bench-e2e: all
	@tools/bench-e2e --build $(B) $(if $(TRACE),--trace $(TRACE)) \
	    $(if $(REQUESTS),--requests $(REQUESTS)) $(if $(ENGINES),--engines $(ENGINES)) \
	    $(if $(SPEEDUP),--speedup $(SPEEDUP)) \
	    $(if $(filter-out 0,$(SUITE)),--suite $(if $(SUITE_RUNS),--runs $(SUITE_RUNS)) \
	        $(if $(WORKLOADS),--workloads $(WORKLOADS)) $(if $(SEED),--seed $(SEED)))

# disaggregation: 8 mock engines as 8 aggregated, 4 prefill + 4 decode, 2 + 6 (docs/BENCHMARKS.md)
bench-disagg: all
	@tools/bench-disagg --build $(B) $(if $(REQUESTS),--requests $(REQUESTS)) \
	    $(if $(RATE),--rate $(RATE)) $(if $(FLEETS),--fleets $(FLEETS))

clean:
	rm -rf build
