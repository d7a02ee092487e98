/* librocm_sysdeps_z.so.1: the zlib that the libLLVM.so in the rocm-bindings-compiler wheel links
   against (symbol version AMDROCM_SYSDEPS_1.0, normally shipped by ROCm/TheRock), forwarding to the
   system's libz.so.1.  Only the functions that libLLVM.so imports (nm -D --with-symbol-versions).
   Built by .ci/rocm-env.sh with ver.map. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void *sym(const char *name) {
    static void *lib;
    if (!lib && !(lib = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL))) {
        fprintf(stderr, "librocm_sysdeps_z shim: %s\n", dlerror());
        abort();
    }
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "librocm_sysdeps_z shim: no %s in libz.so.1\n", name);
        abort();
    }
    return f;
}

int uncompress(unsigned char *dst, unsigned long *dst_len, const unsigned char *src,
               unsigned long src_len) {
    return ((int (*)(unsigned char *, unsigned long *, const unsigned char *, unsigned long))
                sym("uncompress"))(dst, dst_len, src, src_len);
}

int compress2(unsigned char *dst, unsigned long *dst_len, const unsigned char *src,
              unsigned long src_len, int level) {
    return ((int (*)(unsigned char *, unsigned long *, const unsigned char *, unsigned long, int))
                sym("compress2"))(dst, dst_len, src, src_len, level);
}

unsigned long compressBound(unsigned long src_len) {
    return ((unsigned long (*)(unsigned long))sym("compressBound"))(src_len);
}

unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int len) {
    return ((unsigned long (*)(unsigned long, const unsigned char *, unsigned int))sym("crc32"))(
        crc, buf, len);
}
