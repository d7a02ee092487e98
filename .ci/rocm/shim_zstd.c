/* librocm_sysdeps_zstd.so.1: the zstd that the libLLVM.so in the rocm-bindings-compiler wheel
   links against (symbol version AMDROCM_SYSDEPS_1.0), forwarding to the system's libzstd.so.1.
   Only the functions that libLLVM.so imports.  Built by .ci/rocm-env.sh with ver.map. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

static void *sym(const char *name) {
    static void *lib;
    if (!lib && !(lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL))) {
        fprintf(stderr, "librocm_sysdeps_zstd shim: %s\n", dlerror());
        abort();
    }
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "librocm_sysdeps_zstd shim: no %s in libzstd.so.1\n", name);
        abort();
    }
    return f;
}

void *ZSTD_createCCtx(void) { return ((void *(*)(void))sym("ZSTD_createCCtx"))(); }

size_t ZSTD_freeCCtx(void *cctx) { return ((size_t (*)(void *))sym("ZSTD_freeCCtx"))(cctx); }

size_t ZSTD_CCtx_setParameter(void *cctx, int param, int value) {
    return ((size_t (*)(void *, int, int))sym("ZSTD_CCtx_setParameter"))(cctx, param, value);
}

size_t ZSTD_compress2(void *cctx, void *dst, size_t dst_cap, const void *src, size_t src_size) {
    return ((size_t (*)(void *, void *, size_t, const void *, size_t))sym("ZSTD_compress2"))(
        cctx, dst, dst_cap, src, src_size);
}

size_t ZSTD_compressBound(size_t src_size) {
    return ((size_t (*)(size_t))sym("ZSTD_compressBound"))(src_size);
}

size_t ZSTD_decompress(void *dst, size_t dst_cap, const void *src, size_t src_size) {
    return ((size_t (*)(void *, size_t, const void *, size_t))sym("ZSTD_decompress"))(
        dst, dst_cap, src, src_size);
}

unsigned ZSTD_isError(size_t code) { return ((unsigned (*)(size_t))sym("ZSTD_isError"))(code); }

const char *ZSTD_getErrorName(size_t code) {
    return ((const char *(*)(size_t))sym("ZSTD_getErrorName"))(code);
}
