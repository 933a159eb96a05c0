// Validate a GGUF file's bytes before ggml's parser sees them.
//
// A hostile file can lie about every count, length, type, shape and offset. This walker checks each one against the
// real file size (so nothing is allocated from an untrusted number), rejects unknown types, more than 4 dims,
// overflowing shapes, misaligned or out-of-file tensor data, empty or duplicate keys and duplicate names. Only then does model.c hand the
// bytes to gguf_init_from_buffer.
#define _POSIX_C_SOURCE 200809L  // fstat, O_CLOEXEC under -std=c11
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine.h"

enum { GGUF_T_U8, GGUF_T_I8, GGUF_T_U16, GGUF_T_I16, GGUF_T_U32, GGUF_T_I32, GGUF_T_F32, GGUF_T_BOOL,
       GGUF_T_STRING, GGUF_T_ARRAY, GGUF_T_U64, GGUF_T_I64, GGUF_T_F64, GGUF_T_COUNT };

#define MAX_NAME_BYTES 63          // ggml tensor names must fit GGML_MAX_NAME with the terminator
#define MAX_KEY_BYTES (1u << 16)

typedef struct cursor {
    const uint8_t *data;
    size_t size;
    size_t pos;
    char *err;
    size_t err_len;
} cursor;

static size_t remaining(const cursor *c) { return c->size - c->pos; }

static bool take(cursor *c, void *out, size_t n, const char *what) {
    if (remaining(c) < n) {
        dg_set_err(c->err, c->err_len, "truncated GGUF: %s at byte %zu runs past the end of the file", what, c->pos);
        return false;
    }
    if (out) memcpy(out, c->data + c->pos, n);
    c->pos += n;
    return true;
}

static bool take_u32(cursor *c, uint32_t *v, const char *what) { return take(c, v, 4, what); }
static bool take_u64(cursor *c, uint64_t *v, const char *what) { return take(c, v, 8, what); }

// A GGUF string: u64 length + bytes. Returns a pointer into the file (not terminated).
static bool take_string(cursor *c, const uint8_t **s, uint64_t *len, uint64_t max_len, const char *what) {
    if (!take_u64(c, len, what)) return false;
    if (*len > remaining(c)) {
        dg_set_err(c->err, c->err_len, "invalid GGUF: %s length %llu exceeds the file", what, (unsigned long long)*len);
        return false;
    }
    if (*len > max_len) {
        dg_set_err(c->err, c->err_len, "invalid GGUF: %s length %llu exceeds the limit %llu", what,
                   (unsigned long long)*len, (unsigned long long)max_len);
        return false;
    }
    *s = c->data + c->pos;
    c->pos += *len;
    return true;
}

static size_t scalar_size(uint32_t type) {
    switch (type) {
        case GGUF_T_U8: case GGUF_T_I8: case GGUF_T_BOOL: return 1;
        case GGUF_T_U16: case GGUF_T_I16: return 2;
        case GGUF_T_U32: case GGUF_T_I32: case GGUF_T_F32: return 4;
        case GGUF_T_U64: case GGUF_T_I64: case GGUF_T_F64: return 8;
        default: return 0;
    }
}

static bool skip_value(cursor *c, uint32_t type, const char *key) {
    if (type == GGUF_T_STRING) {
        const uint8_t *s;
        uint64_t len;
        return take_string(c, &s, &len, UINT64_MAX, "string value");
    }
    if (type == GGUF_T_ARRAY) {
        uint32_t elem_type;
        uint64_t n;
        if (!take_u32(c, &elem_type, "array type") || !take_u64(c, &n, "array length")) return false;
        if (elem_type == GGUF_T_STRING) {
            if (n > remaining(c) / 8) {  // every string needs at least its 8-byte length
                dg_set_err(c->err, c->err_len, "invalid GGUF: array '%s' claims %llu strings, more than the file holds",
                           key, (unsigned long long)n);
                return false;
            }
            for (uint64_t i = 0; i < n; i++) {
                const uint8_t *s;
                uint64_t len;
                if (!take_string(c, &s, &len, UINT64_MAX, "array string")) return false;
            }
            return true;
        }
        size_t es = scalar_size(elem_type);
        if (es == 0) {
            dg_set_err(c->err, c->err_len, "invalid GGUF: array '%s' has unsupported element type %u", key, elem_type);
            return false;
        }
        if (n > remaining(c) / es) {
            dg_set_err(c->err, c->err_len, "invalid GGUF: array '%s' length %llu exceeds the file", key,
                       (unsigned long long)n);
            return false;
        }
        c->pos += (size_t)n * es;
        return true;
    }
    size_t es = scalar_size(type);
    if (es == 0) {
        dg_set_err(c->err, c->err_len, "invalid GGUF: key '%s' has unknown value type %u", key, type);
        return false;
    }
    return take(c, NULL, es, "value");
}

typedef struct name_ref {
    const uint8_t *s;
    uint64_t len;
} name_ref;

static int cmp_name(const void *a, const void *b) {
    const name_ref *x = a, *y = b;
    uint64_t n = x->len < y->len ? x->len : y->len;
    int r = memcmp(x->s, y->s, n);
    if (r != 0) return r;
    return x->len < y->len ? -1 : x->len > y->len;
}

// The key/value section: every key non-empty and unique (ggml's own parser would log and fail on a duplicate),
// every value skipped with bounds checks; general.alignment read into *alignment.
static bool check_keys(cursor *cur, uint64_t n_kv, name_ref *keys, uint64_t *alignment) {
    cursor c = *cur;
    char *err = c.err;
    size_t err_len = c.err_len;
    for (uint64_t i = 0; i < n_kv; i++) {
        const uint8_t *key;
        uint64_t key_len;
        uint32_t type;
        if (!take_string(&c, &key, &key_len, MAX_KEY_BYTES, "key")) return false;
        if (key_len == 0) {
            dg_set_err(err, err_len, "invalid GGUF: empty metadata key");
            return false;
        }
        keys[i].s = key;
        keys[i].len = key_len;
        if (!take_u32(&c, &type, "value type")) return false;
        char key_z[128];
        size_t kz = key_len < sizeof(key_z) - 1 ? (size_t)key_len : sizeof(key_z) - 1;
        memcpy(key_z, key, kz);
        key_z[kz] = 0;
        if (key_len == strlen("general.alignment") && memcmp(key, "general.alignment", key_len) == 0) {
            uint32_t a;
            if (type != GGUF_T_U32 || !take_u32(&c, &a, "alignment")) {
                dg_set_err(err, err_len, "invalid GGUF: general.alignment must be a uint32");
                return false;
            }
            if (a == 0 || (a & (a - 1)) != 0) {
                dg_set_err(err, err_len, "invalid GGUF: alignment %u is not a power of two", a);
                return false;
            }
            *alignment = a;
            continue;
        }
        if (!skip_value(&c, type, key_z)) return false;
    }
    qsort(keys, n_kv, sizeof(name_ref), cmp_name);
    for (uint64_t i = 1; i < n_kv; i++) {
        if (cmp_name(&keys[i - 1], &keys[i]) == 0) {
            char key_z[128];
            size_t kz = keys[i].len < sizeof(key_z) - 1 ? (size_t)keys[i].len : sizeof(key_z) - 1;
            memcpy(key_z, keys[i].s, kz);
            key_z[kz] = 0;
            dg_set_err(err, err_len, "invalid GGUF: duplicate metadata key '%s'", key_z);
            return false;
        }
    }
    cur->pos = c.pos;
    return true;
}

// checked a*b for non-negative int64
static bool mul_ok(int64_t a, int64_t b, int64_t *out) {
    if (a != 0 && b > INT64_MAX / a) return false;
    *out = a * b;
    return true;
}

bool dg_gguf_check(const uint8_t *data, size_t size, char *err, size_t err_len) {
    cursor c = {data, size, 0, err, err_len};
    uint32_t magic, version;
    uint64_t n_tensors, n_kv;
    if (size < 24) {
        dg_set_err(err, err_len, "not a GGUF file: only %zu bytes", size);
        return false;
    }
    take_u32(&c, &magic, "magic");
    if (memcmp(&magic, "GGUF", 4) != 0) {
        dg_set_err(err, err_len, "not a GGUF file (bad magic)");
        return false;
    }
    take_u32(&c, &version, "version");
    if (version != 2 && version != 3) {
        dg_set_err(err, err_len, "unsupported GGUF version %u (expected 3)", version);
        return false;
    }
    take_u64(&c, &n_tensors, "tensor count");
    take_u64(&c, &n_kv, "key count");
    // smallest possible entries: key = 8-byte length + 1 char + 4-byte type + 1-byte value;
    // tensor info = 8-byte length + 1 char + 4 n_dims + 8 ne + 4 type + 8 offset
    if (n_kv > remaining(&c) / 14 || n_tensors > remaining(&c) / 33) {
        dg_set_err(err, err_len, "truncated or invalid GGUF: %llu keys / %llu tensors cannot fit in a %zu-byte file",
                   (unsigned long long)n_kv, (unsigned long long)n_tensors, size);
        return false;
    }

    uint64_t alignment = 32;  // GGUF default
    name_ref *keys = calloc(n_kv ? n_kv : 1, sizeof(name_ref));  // n_kv is bounded by the file size above
    if (!keys) {
        dg_set_err(err, err_len, "out of memory while checking the GGUF");
        return false;
    }
    if (!check_keys(&c, n_kv, keys, &alignment)) {
        free(keys);
        return false;
    }
    free(keys);

    name_ref *names = calloc(n_tensors ? n_tensors : 1, sizeof(name_ref));
    uint64_t *offsets = calloc(n_tensors ? n_tensors : 1, sizeof(uint64_t));
    uint64_t *nbytes = calloc(n_tensors ? n_tensors : 1, sizeof(uint64_t));
    bool ok = false;
    if (!names || !offsets || !nbytes) {
        dg_set_err(err, err_len, "out of memory while checking the GGUF");
        goto done;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        uint32_t n_dims, type;
        if (!take_string(&c, &names[i].s, &names[i].len, UINT64_MAX, "tensor name")) goto done;
        char name_z[MAX_NAME_BYTES + 1];
        size_t nz = names[i].len < MAX_NAME_BYTES ? (size_t)names[i].len : MAX_NAME_BYTES;
        memcpy(name_z, names[i].s, nz);
        name_z[nz] = 0;
        if (names[i].len == 0 || names[i].len > MAX_NAME_BYTES) {
            dg_set_err(err, err_len, "invalid GGUF: tensor name '%s' has length %llu (1..%d allowed)", name_z,
                       (unsigned long long)names[i].len, MAX_NAME_BYTES);
            goto done;
        }
        if (!take_u32(&c, &n_dims, "tensor n_dims")) goto done;
        if (n_dims < 1 || n_dims > 4) {
            dg_set_err(err, err_len, "invalid GGUF: tensor '%s' has %u dimensions (1..4 allowed)", name_z, n_dims);
            goto done;
        }
        int64_t ne[4] = {1, 1, 1, 1};
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t v;
            if (!take_u64(&c, &v, "tensor shape")) goto done;
            if (v == 0 || v > (uint64_t)INT64_MAX) {
                dg_set_err(err, err_len, "invalid GGUF: tensor '%s' dimension %u is %llu", name_z, d,
                           (unsigned long long)v);
                goto done;
            }
            ne[d] = (int64_t)v;
        }
        if (!take_u32(&c, &type, "tensor type") || !take_u64(&c, &offsets[i], "tensor offset")) goto done;
        if (type >= GGML_TYPE_COUNT || ggml_get_type_traits((enum ggml_type)type)->blck_size == 0 ||
            ggml_get_type_traits((enum ggml_type)type)->type_size == 0) {
            dg_set_err(err, err_len, "invalid GGUF: tensor '%s' has unknown type %u", name_z, type);
            goto done;
        }
        const int64_t blck = ggml_blck_size((enum ggml_type)type);
        if (ne[0] % blck != 0) {
            dg_set_err(err, err_len, "invalid GGUF: tensor '%s' row of %lld elements is not a multiple of the %s block (%lld)",
                       name_z, (long long)ne[0], ggml_type_name((enum ggml_type)type), (long long)blck);
            goto done;
        }
        int64_t n_elem = ne[0], rows = 1, row_bytes, total;
        bool fits = mul_ok(n_elem, ne[1], &n_elem) && mul_ok(n_elem, ne[2], &n_elem) && mul_ok(n_elem, ne[3], &n_elem) &&
                    mul_ok(rows, ne[1], &rows) && mul_ok(rows, ne[2], &rows) && mul_ok(rows, ne[3], &rows) &&
                    mul_ok(ne[0] / blck, (int64_t)ggml_type_size((enum ggml_type)type), &row_bytes) &&
                    mul_ok(rows, row_bytes, &total);
        if (!fits || (uint64_t)total > size) {
            dg_set_err(err, err_len, "invalid GGUF: tensor '%s' shape [%lld, %lld, %lld, %lld] is larger than the file",
                       name_z, (long long)ne[0], (long long)ne[1], (long long)ne[2], (long long)ne[3]);
            goto done;
        }
        nbytes[i] = (uint64_t)total;
        if (offsets[i] % alignment != 0) {
            dg_set_err(err, err_len, "invalid GGUF: tensor '%s' offset %llu is not aligned to %llu", name_z,
                       (unsigned long long)offsets[i], (unsigned long long)alignment);
            goto done;
        }
    }
    // tensor data starts at the next multiple of the alignment
    uint64_t data_start = c.pos + (alignment - c.pos % alignment) % alignment;
    if (n_tensors > 0 && data_start > size) {
        dg_set_err(err, err_len, "truncated GGUF: the tensor data section starts past the end of the file");
        goto done;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        uint64_t avail = size - data_start;
        if (offsets[i] > avail || nbytes[i] > avail - offsets[i]) {
            char name_z[MAX_NAME_BYTES + 1];
            memcpy(name_z, names[i].s, names[i].len);
            name_z[names[i].len] = 0;
            dg_set_err(err, err_len,
                       "truncated or invalid GGUF: tensor '%s' data (offset %llu, %llu bytes) lies past the end of the file",
                       name_z, (unsigned long long)offsets[i], (unsigned long long)nbytes[i]);
            goto done;
        }
    }
    // ggml's reader requires the data packed in tensor order, each padded to the alignment; say so clearly
    uint64_t expected = 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        if (offsets[i] != expected) {
            char name_z[MAX_NAME_BYTES + 1];
            memcpy(name_z, names[i].s, names[i].len);
            name_z[names[i].len] = 0;
            dg_set_err(err, err_len, "invalid GGUF: tensor '%s' data offset %llu, expected %llu (sizes and offsets disagree)",
                       name_z, (unsigned long long)offsets[i], (unsigned long long)expected);
            goto done;
        }
        uint64_t padded = nbytes[i] + (alignment - nbytes[i] % alignment) % alignment;
        if (padded > size) {
            dg_set_err(err, err_len, "invalid GGUF: tensor data larger than the file");
            goto done;
        }
        expected += padded;
    }
    qsort(names, n_tensors, sizeof(name_ref), cmp_name);
    for (uint64_t i = 1; i < n_tensors; i++) {
        if (cmp_name(&names[i - 1], &names[i]) == 0) {
            char name_z[MAX_NAME_BYTES + 1];
            memcpy(name_z, names[i].s, names[i].len);
            name_z[names[i].len] = 0;
            dg_set_err(err, err_len, "invalid GGUF: duplicate tensor name '%s'", name_z);
            goto done;
        }
    }
    ok = true;
done:
    free(names);
    free(offsets);
    free(nbytes);
    return ok;
}

// Map `path` read-only, check its bytes (dg_gguf_check) and parse it with ggml: tensor metadata in *ctx_file, the
// data left in the mapping. On failure err is set; whatever was mapped is left in *map / *map_size (MAP_FAILED when
// nothing) for the caller's cleanup to unmap.
bool dg_gguf_map(const char *path, void **map, size_t *map_size, struct gguf_context **gguf,
                 struct ggml_context **ctx_file, char *err, size_t err_len) {
    *map = MAP_FAILED;
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        dg_set_err(err, err_len, "cannot open '%s'", path);
        return false;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        dg_set_err(err, err_len, "'%s' is not a regular file", path);
        return false;
    }
    *map_size = (size_t)st.st_size;
    if (*map_size < 24) {
        close(fd);
        dg_set_err(err, err_len, "not a GGUF file: '%s' has only %zu bytes", path, *map_size);
        return false;
    }
    *map = mmap(NULL, *map_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (*map == MAP_FAILED) {
        dg_set_err(err, err_len, "cannot memory-map '%s'", path);
        return false;
    }
    if (!dg_gguf_check(*map, *map_size, err, err_len)) return false;
    struct gguf_init_params gp = {true, ctx_file};
    *gguf = gguf_init_from_buffer(*map, *map_size, gp);
    if (!*gguf || !*ctx_file) {
        dg_set_err(err, err_len, "ggml could not parse the GGUF file '%s'", path);
        return false;
    }
    return true;
}

// What dg_gguf_map made, released (each part may be missing).
void dg_gguf_unmap(void *map, size_t map_size, struct gguf_context *gguf, struct ggml_context *ctx_file) {
    if (ctx_file) ggml_free(ctx_file);
    if (gguf) gguf_free(gguf);
    if (map != MAP_FAILED && map != NULL) munmap(map, map_size);
}
