/*
 * --engine cuda: the CUDA engine lives in libkvcuda.so, built from
 * the workers/cuda sources only where nvcc exists, and is loaded at run time so
 * that kvworker itself never needs CUDA libraries. Looked up next to the
 * binary (../lib/libkvcuda.so), then on the library path.
 *
 * KVW_CUDA_LIB=PATH loads that library instead: the tests point it at
 * libkvcuda-emu.so, the same engine built against the host emulation of
 * CUDA (workers/cuda/emu), to run it without a GPU.
 */
#include <stdlib.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvw_backend.h"

typedef kvw_backend_t *(*create_fn)(const kvw_backend_config_t *cfg, char *err, size_t errlen);

kvw_backend_t *kvw_cuda_backend_create(const kvw_backend_config_t *cfg, char *err, size_t errlen)
{
    char      exe[PATH_MAX], path[PATH_MAX + 32];
    ssize_t   n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    void     *h = NULL;
    create_fn create;
    char     *slash;
    const char *forced = getenv("KVW_CUDA_LIB");

    if (forced && *forced) {
        h = dlopen(forced, RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) {
            snprintf(err, errlen, "the CUDA engine is not available: KVW_CUDA_LIB=%s: %s",
                     forced, dlerror());
            return NULL;
        }
    } else if (n > 0) {
        exe[n] = '\0';
        slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            snprintf(path, sizeof(path), "%s/../lib/libkvcuda.so", exe);
            h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        }
    }
    if (h == NULL && !(forced && *forced)) {
        h = dlopen("libkvcuda.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (h == NULL) {
        snprintf(err, errlen, "the CUDA engine is not available: libkvcuda.so was not found "
                 "(it is built only where nvcc exists): %s", dlerror());
        return NULL;
    }
    create = (create_fn) dlsym(h, "kvw_cuda_backend_create_impl");
    if (create == NULL) {
        snprintf(err, errlen, "libkvcuda.so lacks kvw_cuda_backend_create_impl");
        dlclose(h);
        return NULL;
    }
    return create(cfg, err, errlen);
}
