/*
 * generate.c: the klein C API end to end on one bundle.
 *
 *   cargo build --release        # target/release/libklein.so and target/release/include/klein.h
 *   cc examples/c/generate.c -I target/release/include -L target/release -lklein \
 *      -Wl,-rpath,"$PWD/target/release" -o generate
 *   ./generate onnx/klein-tiny [out.ppm]
 *
 * ONNX Runtime is found as by the Rust library: ORT_DYLIB_PATH, else the path baked in at build
 * time (KLEIN_ORT_DYLIB=$(scripts/setup-ort.sh) cargo build --release).
 *
 * 1. loads the bundle (CPU, 1 thread); 2. sizes the buffer with klein_output_size; a short buffer
 * is refused (KLEIN_ERROR_BUFFER_TOO_SMALL) and a bad size is a user error (KLEIN_ERROR_USER);
 * 3. generates a 64x64 image, seed 42, 2 steps, printing each step (and writes it as PPM when a
 * path is given); 4. a second generation whose callback cancels at step 1 returns KLEIN_CANCELLED
 * and leaves the buffer untouched; 5. a third equals the first byte for byte.
 * Prints "all checks passed" and exits 0 when every check holds, else exits 1.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "klein.h"

static int failures = 0;

static const char *status_name(KleinStatus status) {
    switch (status) {
    case KLEIN_OK: return "KLEIN_OK";
    case KLEIN_ERROR_INVALID_ARGUMENT: return "KLEIN_ERROR_INVALID_ARGUMENT";
    case KLEIN_ERROR_USER: return "KLEIN_ERROR_USER";
    case KLEIN_ERROR_RUNTIME: return "KLEIN_ERROR_RUNTIME";
    case KLEIN_CANCELLED: return "KLEIN_CANCELLED";
    case KLEIN_ERROR_PANIC: return "KLEIN_ERROR_PANIC";
    case KLEIN_ERROR_BUFFER_TOO_SMALL: return "KLEIN_ERROR_BUFFER_TOO_SMALL";
    default: return "unknown status";
    }
}

/* Reports `what` returning `status` (expected: `want`), prints and frees its message. `message` is
 * passed by address: it is read here, after the call has set it (argument order is unspecified). */
static int expect(const char *what, KleinStatus status, KleinStatus want, char **message) {
    int ok = status == want;
    printf("%s: %s%s%s\n", what, status_name(status), *message ? ": " : "", *message ? *message : "");
    if (!ok) {
        fprintf(stderr, "FAILED: %s returned %s, expected %s\n", what, status_name(status), status_name(want));
        failures++;
    }
    klein_string_free(*message);
    *message = NULL;
    return ok;
}

static void check(int condition, const char *what) {
    printf("%s: %s\n", what, condition ? "yes" : "NO");
    if (!condition) {
        fprintf(stderr, "FAILED: %s\n", what);
        failures++;
    }
}

/* Progress state: the label printed with each step, and the step to cancel at (0: never). */
struct progress {
    const char *label;
    uint32_t cancel_at;
};

static int32_t on_progress(void *user_data, uint32_t step, uint32_t total) {
    const struct progress *p = user_data;
    printf("%s: step %u/%u\n", p->label, step, total);
    return p->cancel_at != 0 && step >= p->cancel_at;
}

/* An image is not trivial when its colour channels take more than one value and alpha is opaque. */
static int non_trivial(const uint8_t *rgba, size_t len) {
    int varied = 0;
    for (size_t i = 0; i < len; i++) {
        if (i % 4 == 3) {
            if (rgba[i] != 255) return 0;
        } else if (rgba[i] != rgba[0]) {
            varied = 1;
        }
    }
    return varied;
}

static int write_ppm(const char *path, const uint8_t *rgba, uint32_t width, uint32_t height) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    fprintf(f, "P6\n%u %u\n255\n", width, height);
    for (size_t i = 0; i < (size_t)width * height; i++) fwrite(rgba + 4 * i, 1, 3, f);
    return fclose(f) == 0;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s BUNDLE_DIR [OUT.ppm]\n", argv[0]);
        return 2;
    }
    char *message = NULL;

    /* 1. Load. */
    KleinOptions options = {0};
    options.device = "cpu";
    options.threads = 1;
    KleinPipeline *pipeline = NULL;
    if (!expect("load", klein_pipeline_load(argv[1], &options, &pipeline, &message), KLEIN_OK, &message)) return 1;

    /* 2. Size the buffer; a short one and a bad size are refused. */
    KleinRequest request = {0};
    request.prompt = "a red fox in the snow";
    request.seed = 42;
    request.width = 64;
    request.height = 64;
    request.steps = 2;
    uint32_t width = 0, height = 0;
    if (!expect("output size", klein_output_size(pipeline, &request, &width, &height, &message), KLEIN_OK, &message)) {
        klein_pipeline_free(pipeline);
        return 1;
    }
    printf("output size: %ux%u\n", width, height);
    size_t len = (size_t)width * height * 4;
    uint8_t *first = malloc(len), *cancelled = malloc(len), *third = malloc(len);
    if (!first || !cancelled || !third) {
        fprintf(stderr, "out of memory\n");
        klein_pipeline_free(pipeline);
        return 1;
    }
    uint8_t small[16];
    uint32_t needed_w = 0, needed_h = 0;
    expect("short buffer",
           klein_generate(pipeline, &request, small, sizeof small, &needed_w, &needed_h, NULL, NULL, &message),
           KLEIN_ERROR_BUFFER_TOO_SMALL, &message);
    check(needed_w == width && needed_h == height, "short buffer reports the size needed");
    KleinRequest bad = request;
    bad.width = 8;
    expect("width 8", klein_output_size(pipeline, &bad, &needed_w, &needed_h, &message), KLEIN_ERROR_USER, &message);

    /* 3. Generate, with progress. */
    struct progress first_progress = {"first", 0};
    expect("first generation",
           klein_generate(pipeline, &request, first, len, &width, &height, on_progress, &first_progress, &message),
           KLEIN_OK, &message);
    check(non_trivial(first, len), "first image is non-trivial");
    if (argc == 3) check(write_ppm(argv[2], first, width, height), "PPM written");

    /* 4. Cancel at step 1: KLEIN_CANCELLED, buffer untouched. */
    memset(cancelled, 0xAB, len);
    struct progress cancel_progress = {"cancelled", 1};
    expect("cancelled generation",
           klein_generate(pipeline, &request, cancelled, len, NULL, NULL, on_progress, &cancel_progress, &message),
           KLEIN_CANCELLED, &message);
    int untouched = 1;
    for (size_t i = 0; i < len; i++) untouched &= cancelled[i] == 0xAB;
    check(untouched, "cancelled generation left the buffer untouched");

    /* 5. The pipeline still works, and is deterministic. */
    struct progress third_progress = {"third", 0};
    expect("third generation",
           klein_generate(pipeline, &request, third, len, NULL, NULL, on_progress, &third_progress, &message),
           KLEIN_OK, &message);
    check(memcmp(first, third, len) == 0, "third image equals the first byte for byte");

    klein_pipeline_free(pipeline);
    free(first);
    free(cancelled);
    free(third);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
