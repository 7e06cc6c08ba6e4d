# kvroute: nginx module, workers and tools.
#
#   make                 build everything into build/
#   make test            build, run every test, end with "N passed, N failed"
#   make test SANITIZE=1 the same under ASan+UBSan, built into build/san/
#   make run [PORT=8080] demo stack: nats-server, 4 mock workers, nginx
#   make bench           benchmarks (minutes); results go to docs/BENCHMARKS.md by hand
#   make CUDA=0          skip the CUDA engine even where nvcc exists
#
# Sources are found by globbing, so adding a file needs no edit here:
#   src/core/*.c        -> build/lib/libkvcore.a (no nginx headers)
#   src/ngx/*.c         -> build/modules/ngx_http_kvroute_module.so (see ./config)
#   workers/*.c         -> build/bin/kvworker (main.c) + build/lib/libkvworker.a
#   workers/cuda/*.cu   -> build/lib/libkvcuda.so, loaded by kvworker --engine cuda
#   tools/<name>/*.c    -> build/bin/<name>
#   t/unit/test_*.c     -> build/t/test_*  (linked with both libraries)
#   t/fuzz/fuzz_*.c     -> build/fuzz/fuzz_* (clang libFuzzer, `make fuzz`)

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
            -D_GNU_SOURCE -Isrc/core -Iworkers $(SANFLAGS) $(EXTRA_CFLAGS)
LDFLAGS  := -pthread $(SANFLAGS)
LIBS     := -levent -levent_pthreads -lnats -ljansson -lxxhash -lutf8proc -ldl -lm
VENV     := .venv
PY       := $(VENV)/bin/python

CORE_SRC   := $(wildcard src/core/*.c)
CORE_OBJ   := $(CORE_SRC:%.c=$(B)/obj/%.o)
WORK_SRC   := $(filter-out workers/main.c,$(wildcard workers/*.c))
WORK_OBJ   := $(WORK_SRC:%.c=$(B)/obj/%.o)
TOOL_NAMES := $(notdir $(patsubst %/,%,$(dir $(wildcard tools/*/main.c))))
TOOL_BINS  := $(TOOL_NAMES:%=$(B)/bin/%)
UNIT_SRC   := $(wildcard t/unit/test_*.c)
UNIT_BINS  := $(UNIT_SRC:t/unit/%.c=$(B)/t/%)
FUZZ_SRC   := $(wildcard t/fuzz/fuzz_*.c)
FUZZ_BINS  := $(FUZZ_SRC:t/fuzz/%.c=$(B)/fuzz/%)
CUDA_SRC   := $(wildcard workers/cuda/*.cu)
HEADERS    := $(wildcard src/core/*.h workers/*.h)

CORE_LIB   := $(B)/lib/libkvcore.a
WORK_LIB   := $(B)/lib/libkvworker.a
MODULE     := $(B)/modules/ngx_http_kvroute_module.so
KVWORKER   := $(B)/bin/kvworker
ifeq ($(CUDA),1)
ifneq ($(CUDA_SRC),)
CUDA_LIB   := $(B)/lib/libkvcuda.so
endif
endif

.PHONY: all deps core module bins test unit run bench bench-e2e fuzz clean
.DEFAULT_GOAL := all

all: deps
	@$(MAKE) --no-print-directory build-all

build-all: $(CORE_LIB) $(WORK_LIB) $(MODULE) $(KVWORKER) $(TOOL_BINS) $(CUDA_LIB) $(UNIT_BINS)

deps:
	@tools/install-deps

# --- src/core -------------------------------------------------------------

$(B)/obj/%.o: %.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(CORE_LIB): $(CORE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(WORK_LIB): $(WORK_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# --- nginx module ---------------------------------------------------------
# Debian's recipe (docs/BUILD.md): configure with the distribution's flags so
# the module is binary compatible with /usr/sbin/nginx, then build only the
# modules target. configure is slow (~6 s), so it reruns only when ./config
# or the flags change.

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
	cd $(NGX_SRC) && KVROUTE_BUILD=$(abspath $(B)) bash -c '. ./conf_flags; \
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
$(B)/bin/%: $$(addprefix $(B)/obj/,$$(subst .c,.o,$$(wildcard tools/$$*/*.c))) $(WORK_LIB) $(CORE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(filter %.o,$^) $(WORK_LIB) $(CORE_LIB) $(LIBS)

# kvw_model.o and kvw_sample.o come from libkvworker.a (built -fPIC)
# The CUDA engine reuses the model loader and the sampler: their objects are
# built again without sanitizers (the .so is loaded by sanitized and plain
# binaries alike). PTX for compute_90 lets newer GPUs JIT the kernels; the
# rpath finds cuBLAS where nvcc's toolkit lives.
CUDA_HOST_OBJ := $(B)/obj/cuda-host/kvw_model.o $(B)/obj/cuda-host/kvw_sample.o
CUDA_LIBDIR   := $(abspath $(dir $(shell command -v $(NVCC) 2>/dev/null))../lib64)

$(B)/obj/cuda-host/%.o: workers/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out $(SANFLAGS),$(CFLAGS)) -c -o $@ $<

$(B)/lib/libkvcuda.so: $(CUDA_SRC) $(wildcard workers/cuda/*.h workers/cuda/*.cuh) $(HEADERS) \
                       $(CUDA_HOST_OBJ)
	@mkdir -p $(dir $@)
	$(NVCC) -O3 -std=c++17 -Xcompiler -fPIC,-Wall -shared -Isrc/core -Iworkers \
	    -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=sm_80 \
	    -gencode arch=compute_90,code=compute_90 \
	    -o $@ $(CUDA_SRC) $(CUDA_HOST_OBJ) -lcublas -ljansson -Xlinker -rpath=$(CUDA_LIBDIR)

# --- tests ----------------------------------------------------------------

$(B)/t/%: t/unit/%.c t/unit/kvtest.h $(WORK_LIB) $(CORE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -It/unit $(LDFLAGS) -o $@ $< $(WORK_LIB) $(CORE_LIB) $(LIBS)

unit: all
	@$(PY) t/run.py --build $(B) --unit-only

test: all
	@$(PY) t/run.py --build $(B) --sanitize $(SANITIZE)

# libFuzzer targets: clang only, always sanitized, separate objects.
FUZZ_CFLAGS := -std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined \
               -D_GNU_SOURCE -Isrc/core -Wall -Wextra -Werror -Wno-unused-parameter

$(B)/fuzz/%: t/fuzz/%.c $(CORE_SRC) $(wildcard src/core/*.h)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -o $@ $< $(CORE_SRC) -lnats -ljansson -lxxhash -lm -lpthread

fuzz: deps $(FUZZ_BINS)
	@tools/fuzz-all $(B)/fuzz $(FUZZ_SECONDS)

# --- running --------------------------------------------------------------

run: all
	@tools/demo --build $(B) --port $(PORT)

bench: all
	@tools/bench-all --build $(B)

bench-e2e: all
	@tools/bench-e2e --build $(B) $(if $(TRACE),--trace $(TRACE)) \
	    $(if $(REQUESTS),--requests $(REQUESTS)) $(if $(ENGINES),--engines $(ENGINES)) \
	    $(if $(SPEEDUP),--speedup $(SPEEDUP))

clean:
	rm -rf build
