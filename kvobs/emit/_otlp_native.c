/* kvobs.emit._otlp_native: an OTLP/protobuf ExportTraceServiceRequest read in one walk of
 * its bytes into (1) the store's line, byte-identical to the Python path's
 * ``json_line(request_json(message))``, and (2) each span's row as ``kvobs.sources._rows``
 * builds it before coercion. The Python path (upb's parse, then a walk of the message
 * object) costs ~30 us a span with the rows, most of it one Python object per field read;
 * this ~4 (bench/README.md, Run 14).
 *
 * It is a fast path, never a second set of rules: anything outside the shapes it knows
 * (an id of unusual length, a double whose text would need an exponent, a message field
 * sent twice, invalid UTF-8, a deep nesting, an entity ref, any malformed byte) makes
 * ``decode`` return None and the caller takes the Python path, which decides as always
 * (including refusing the body). tests/emit/test_ingest_decode.py holds the two equal.
 *
 * Names (row keys, enum names, the row's columns) come from Python (``configure``): the
 * semantic conventions stay in kvobs.semconv.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define OK 0
#define FALLBACK 1 /* outside what this walk knows: the caller takes the Python path */
#define FAIL (-1)  /* a Python exception is set */
#define TRY(expr)                 \
    do {                          \
        int rc_ = (expr);         \
        if (rc_ != OK) return rc_; \
    } while (0)
#define MAX_DEPTH 32 /* nested array/kvlist values; deeper ones are the Python path's */

/* ------------------------------------------------------------------ configuration */

typedef struct {
    const char *text; /* UTF-8, owned by ``key`` */
    Py_ssize_t size;
    PyObject *key;
    int textual; /* the key's values are text: an int value stays its decimal text */
} KeySlot;

#define KEY_SLOTS 1024 /* power of two, well above the row keys (~100) */
static KeySlot row_keys[KEY_SLOTS];
static PyObject *renamed_pairs; /* tuple of (old, new) */
static PyObject *role_key, *service_key;
static const char *role_text, *service_text;
static Py_ssize_t role_size, service_size;
/* the row's columns, in _rows._otlp_span's order */
enum { C_TRACE, C_SPAN, C_PARENT, C_NAME, C_SERVICE, C_START, C_END, C_ERROR, N_COLUMNS };
static PyObject *columns[N_COLUMNS];
static PyObject *kind_names, *code_names; /* tuples: an enum's names by number */
static PyObject *text_nan, *text_inf, *text_minus_inf;
static int configured;

static uint64_t fnv(const uint8_t *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ULL;
    return h;
}

static KeySlot *row_key(const uint8_t *s, size_t n) { /* or NULL */
    for (uint64_t i = fnv(s, n);; i++) {
        KeySlot *slot = &row_keys[i & (KEY_SLOTS - 1)];
        if (slot->key == NULL) return NULL;
        if ((size_t)slot->size == n && memcmp(slot->text, s, n) == 0) return slot;
    }
}

/* --------------------------------------------------------------------- the bytes */

typedef struct {
    uint32_t number;
    int wire;
    uint64_t u; /* a varint, fixed32 or fixed64 */
    const uint8_t *data; /* a length-delimited field */
    size_t size;
} Field;

typedef struct {
    const uint8_t *p, *end;
} Reader;

static int varint(Reader *r, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 64 && r->p < r->end; shift += 7) {
        uint8_t byte = *r->p++;
        if (shift == 63 && byte > 1) return FALLBACK;
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return OK;
        }
    }
    return FALLBACK;
}

static int next_field(Reader *r, Field *f) {
    uint64_t tag;
    TRY(varint(r, &tag));
    if ((tag >> 3) == 0 || (tag >> 3) > 536870911u) return FALLBACK;
    f->number = (uint32_t)(tag >> 3);
    f->wire = (int)(tag & 7);
    switch (f->wire) {
        case 0:
            return varint(r, &f->u);
        case 1:
            if (r->end - r->p < 8) return FALLBACK;
            memcpy(&f->u, r->p, 8);
            r->p += 8;
            return OK;
        case 2: {
            uint64_t size;
            TRY(varint(r, &size));
            if (size > (uint64_t)(r->end - r->p)) return FALLBACK;
            f->data = r->p;
            f->size = (size_t)size;
            r->p += size;
            return OK;
        }
        case 5: {
            uint32_t value;
            if (r->end - r->p < 4) return FALLBACK;
            memcpy(&value, r->p, 4);
            f->u = value;
            r->p += 4;
            return OK;
        }
        default: /* groups: no OTLP field is one */
            return FALLBACK;
    }
}

#define FIELDS(data, size) for (Reader r_ = {(data), (data) + (size)}; r_.p < r_.end;)
#define NEXT(f) TRY(next_field(&r_, &(f)))
#define WIRE(f, w) \
    if ((f).wire != (w)) return FALLBACK

static int as_int32(uint64_t u, int32_t *out) { /* int32 and enum fields */
    if (u <= 0x7fffffffu || u >= 0xffffffff80000000ULL) {
        *out = (int32_t)(uint32_t)u;
        return OK;
    }
    return FALLBACK;
}

static int as_uint32(uint64_t u, uint32_t *out) {
    if (u > 0xffffffffu) return FALLBACK;
    *out = (uint32_t)u;
    return OK;
}

/* ---------------------------------------------------------------------- the line */

typedef struct {
    char *data;
    size_t size, capacity;
} Buf;

static int grow(Buf *b, size_t more) {
    if (b->size + more <= b->capacity) return OK;
    size_t capacity = b->capacity ? b->capacity : 65536;
    while (capacity < b->size + more) capacity *= 2;
    char *data = PyMem_Realloc(b->data, capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return FAIL;
    }
    b->data = data;
    b->capacity = capacity;
    return OK;
}

static int put(Buf *b, const char *s, size_t n) {
    TRY(grow(b, n));
    memcpy(b->data + b->size, s, n);
    b->size += n;
    return OK;
}

#define PUT(b, literal) TRY(put((b), (literal), sizeof(literal) - 1))
#define PUTS(b, text) TRY(put((b), (text), strlen(text)))

/* ``"name":`` after a comma unless it is the object's first member */
static int member(Buf *b, int *first, const char *name) {
    if (!*first) PUT(b, ",");
    *first = 0;
    return put(b, name, strlen(name));
}

static int put_u64(Buf *b, uint64_t v) {
    char digits[24];
    int n = 0;
    do {
        digits[sizeof digits - 1 - n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return put(b, digits + sizeof digits - n, (size_t)n);
}

static int put_i64(Buf *b, int64_t v) {
    if (v < 0) {
        PUT(b, "-");
        return put_u64(b, (uint64_t)0 - (uint64_t)v);
    }
    return put_u64(b, (uint64_t)v);
}

static const char HEX[] = "0123456789abcdef";

static int put_hex(Buf *b, const uint8_t *s, size_t n) {
    TRY(grow(b, 2 * n + 2));
    char *out = b->data + b->size;
    *out++ = '"';
    for (size_t i = 0; i < n; i++) {
        *out++ = HEX[s[i] >> 4];
        *out++ = HEX[s[i] & 15];
    }
    *out++ = '"';
    b->size += 2 * n + 2;
    return OK;
}

static int put_base64(Buf *b, const uint8_t *s, size_t n) {
    static const char ALPHABET[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t size = (n + 2) / 3 * 4 + 2;
    TRY(grow(b, size));
    char *out = b->data + b->size;
    *out++ = '"';
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        *out++ = ALPHABET[v >> 18];
        *out++ = ALPHABET[(v >> 12) & 63];
        *out++ = ALPHABET[(v >> 6) & 63];
        *out++ = ALPHABET[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        *out++ = ALPHABET[v >> 18];
        *out++ = ALPHABET[(v >> 12) & 63];
        *out++ = '=';
        *out++ = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8;
        *out++ = ALPHABET[v >> 18];
        *out++ = ALPHABET[(v >> 12) & 63];
        *out++ = ALPHABET[(v >> 6) & 63];
        *out++ = '=';
    }
    *out++ = '"';
    b->size += size;
    return OK;
}

/* Length of the valid UTF-8 sequence at s (at most n bytes), or 0 (upb refuses the
 * message: the Python path's answer). */
static size_t utf8_sequence(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    if (c >= 0xc2 && c <= 0xdf) return n >= 2 && (s[1] & 0xc0) == 0x80 ? 2 : 0;
    if (c >= 0xe0 && c <= 0xef) {
        if (n < 3 || (s[1] & 0xc0) != 0x80 || (s[2] & 0xc0) != 0x80) return 0;
        if ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] >= 0xa0)) return 0;
        return 3;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        if (n < 4 || (s[1] & 0xc0) != 0x80 || (s[2] & 0xc0) != 0x80 || (s[3] & 0xc0) != 0x80)
            return 0;
        if ((c == 0xf0 && s[1] < 0x90) || (c == 0xf4 && s[1] >= 0x90)) return 0;
        return 4;
    }
    return 0;
}

/* A protobuf string as orjson writes it, then json_line's escapes of U+0085, U+2028 and
 * U+2029 (a raw one breaks str.splitlines()). */
static int put_string(Buf *b, const uint8_t *s, size_t n) {
    TRY(grow(b, n + 2));
    b->data[b->size++] = '"';
    size_t run = 0; /* bytes copied as they are, not yet put */
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        const char *escape = NULL;
        size_t length = 1;
        char unicode[7];
        if (c >= 0x80) {
            length = utf8_sequence(s + i, n - i);
            if (length == 0) return FALLBACK;
            if (length == 2 && c == 0xc2 && s[i + 1] == 0x85)
                escape = "\\u0085";
            else if (length == 3 && c == 0xe2 && s[i + 1] == 0x80 &&
                     (s[i + 2] == 0xa8 || s[i + 2] == 0xa9))
                escape = s[i + 2] == 0xa8 ? "\\u2028" : "\\u2029";
        } else if (c == '"') {
            escape = "\\\"";
        } else if (c == '\\') {
            escape = "\\\\";
        } else if (c < 0x20) {
            switch (c) {
                case '\b': escape = "\\b"; break;
                case '\t': escape = "\\t"; break;
                case '\n': escape = "\\n"; break;
                case '\f': escape = "\\f"; break;
                case '\r': escape = "\\r"; break;
                default:
                    memcpy(unicode, "\\u00", 4);
                    unicode[4] = HEX[c >> 4];
                    unicode[5] = HEX[c & 15];
                    unicode[6] = 0;
                    escape = unicode;
            }
        }
        if (escape == NULL) {
            run += length;
            i += length;
            continue;
        }
        TRY(put(b, (const char *)s + i - run, run));
        run = 0;
        TRY(put(b, escape, strlen(escape)));
        i += length;
    }
    TRY(put(b, (const char *)s + n - run, run));
    PUT(b, "\"");
    return OK;
}

static int valid_utf8(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t length = utf8_sequence(s + i, n - i);
        if (length == 0) return 0;
        i += length;
    }
    return 1;
}

/* A double as orjson writes it: Python's repr (the same shortest digits), but an exponent
 * of -6 to -9 without repr's leading zero (1e-6, not 1e-06), and one of -5 as a decimal
 * (0.00001). Non-finite ones by name, as protobuf's JSON mapping names them. */
static int put_double(Buf *b, double d) {
    if (isnan(d)) {
        PUT(b, "\"NaN\"");
        return OK;
    }
    if (isinf(d)) {
        if (d > 0)
            PUT(b, "\"Infinity\"");
        else
            PUT(b, "\"-Infinity\"");
        return OK;
    }
    char *text = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL) return FAIL;
    char *e = strchr(text, 'e');
    int rc;
    if (e == NULL || e[1] != '-' || e[2] != '0') {
        rc = put(b, text, strlen(text));
    } else if (e[3] == '5' && e[4] == 0) { /* [-]D[.DDD]e-05 -> [-]0.0000DDDD */
        char *digits = text;
        rc = OK;
        if (*digits == '-') rc = put(b, digits++, 1);
        if (rc == OK) rc = put(b, "0.0000", 6);
        for (; rc == OK && digits < e; digits++)
            if (*digits != '.') rc = put(b, digits, 1);
    } else { /* e-0N -> e-N */
        rc = put(b, text, (size_t)(e + 2 - text));
        if (rc == OK) rc = put(b, e + 3, strlen(e + 3));
    }
    PyMem_Free(text);
    return rc;
}

static int put_int32(Buf *b, int32_t v) { return put_i64(b, v); }

static int put_enum(Buf *b, int32_t v, PyObject *names) {
    if (v < 0 || v >= PyTuple_GET_SIZE(names)) return put_int32(b, v);
    Py_ssize_t size;
    const char *text = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(names, v), &size);
    if (text == NULL) return FAIL;
    PUT(b, "\"");
    TRY(put(b, text, (size_t)size));
    PUT(b, "\"");
    return OK;
}

/* ----------------------------------------------------------------------- messages */

typedef struct {
    Buf line;
    PyObject *service, *role; /* the current resource's, or NULL */
} Walk;

static PyObject *decimal(int64_t v) {
    char digits[24];
    int n = snprintf(digits, sizeof digits, "%lld", (long long)v);
    return PyUnicode_FromStringAndSize(digits, n);
}

/* AnyValue: which member is set (its field number, 0 none) and where */
typedef struct {
    uint32_t which;
    Field value;
} Any;

static int any_scan(const uint8_t *data, size_t size, Any *a) {
    a->which = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        if (f.number < 1 || f.number > 8) continue;
        /* the last member wins, but an array or kvlist sent twice in a row is merged */
        if (a->which == f.number && (f.number == 5 || f.number == 6)) return FALLBACK;
        static const int wire_of[9] = {0, 2, 0, 0, 1, 2, 2, 2, 0};
        WIRE(f, wire_of[f.number]);
        a->which = f.number;
        a->value = f;
    }
    return OK;
}

static int key_value(Walk *w, const uint8_t *data, size_t size, PyObject *row, int resource,
                     int depth);
static int any_value(Walk *w, Any *a, int depth);

/* ``"values":[...]`` of an ArrayValue or a KeyValueList (field 1), if any */
static int values(Walk *w, const uint8_t *data, size_t size, int kvlist, int depth) {
    int any = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        if (f.number != 1) continue;
        WIRE(f, 2);
        PUTS(&w->line, any ? "," : "\"values\":[");
        any = 1;
        if (kvlist) {
            TRY(key_value(w, f.data, f.size, NULL, 0, depth + 1));
        } else {
            Any a;
            TRY(any_scan(f.data, f.size, &a));
            TRY(any_value(w, &a, depth + 1));
        }
    }
    if (any) PUT(&w->line, "]");
    return OK;
}

static int any_value(Walk *w, Any *a, int depth) {
    Buf *b = &w->line;
    if (depth > MAX_DEPTH) return FALLBACK;
    Field *f = &a->value;
    int32_t i32;
    switch (a->which) {
        case 0:
            PUT(b, "{}");
            return OK;
        case 1:
            PUT(b, "{\"stringValue\":");
            TRY(put_string(b, f->data, f->size));
            break;
        case 2:
            if (f->u > 1) return FALLBACK;
            if (f->u)
                PUT(b, "{\"boolValue\":true");
            else
                PUT(b, "{\"boolValue\":false");
            break;
        case 3:
            PUT(b, "{\"intValue\":\"");
            TRY(put_i64(b, (int64_t)f->u));
            PUT(b, "\"");
            break;
        case 4: {
            double d;
            memcpy(&d, &f->u, 8);
            PUT(b, "{\"doubleValue\":");
            TRY(put_double(b, d));
            break;
        }
        case 5:
        case 6:
            PUTS(b, a->which == 5 ? "{\"arrayValue\":{" : "{\"kvlistValue\":{");
            TRY(values(w, f->data, f->size, a->which == 6, depth));
            PUT(b, "}");
            break;
        case 7:
            PUT(b, "{\"bytesValue\":");
            TRY(put_base64(b, f->data, f->size));
            break;
        case 8:
            TRY(as_int32(f->u, &i32));
            PUT(b, "{\"stringValueStrindex\":");
            TRY(put_int32(b, i32));
            break;
    }
    PUT(b, "}");
    return OK;
}

/* What a row holds for an AnyValue: a string, an int's decimal text (``as_int``: the int
 * that text coerces to, for a key whose values are numbers), a double (a non-finite one by
 * name), a bool; None for any other value or none (new reference). */
static PyObject *scalar(Any *a, int as_int) {
    Field *f = &a->value;
    switch (a->which) {
        case 1:
            return PyUnicode_DecodeUTF8((const char *)f->data, (Py_ssize_t)f->size, NULL);
        case 2:
            return Py_NewRef(f->u ? Py_True : Py_False);
        case 3:
            return as_int ? PyLong_FromLongLong((long long)(int64_t)f->u) : decimal((int64_t)f->u);
        case 4: {
            double d;
            memcpy(&d, &f->u, 8);
            if (isnan(d)) return Py_NewRef(text_nan);
            if (isinf(d)) return Py_NewRef(d > 0 ? text_inf : text_minus_inf);
            return PyFloat_FromDouble(d);
        }
        default:
            return Py_NewRef(Py_None);
    }
}

static int same_text(const uint8_t *s, size_t n, const char *text, Py_ssize_t size) {
    return (size_t)size == n && memcmp(s, text, n) == 0;
}

/* One KeyValue's object; its value into ``row`` where its key is a row key, or the
 * resource's service and role into ``w`` */
static int key_value(Walk *w, const uint8_t *data, size_t size, PyObject *row, int resource,
                     int depth) {
    const uint8_t *key = (const uint8_t *)"";
    size_t key_size = 0;
    const uint8_t *value = NULL;
    size_t value_size = 0;
    int32_t strindex = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        if (f.number == 1) {
            WIRE(f, 2);
            key = f.data;
            key_size = f.size;
        } else if (f.number == 2) {
            WIRE(f, 2);
            if (value != NULL) return FALLBACK; /* merged by protobuf */
            value = f.data;
            value_size = f.size;
        } else if (f.number == 3) {
            WIRE(f, 0);
            TRY(as_int32(f.u, &strindex));
        }
    }
    if (!valid_utf8(key, key_size)) return FALLBACK;
    Any a = {0};
    if (value != NULL) TRY(any_scan(value, value_size, &a));
    Buf *b = &w->line;
    int first = 1;
    PUT(b, "{");
    if (key_size) {
        TRY(member(b, &first, "\"key\":"));
        TRY(put_string(b, key, key_size));
    }
    if (value != NULL) {
        TRY(member(b, &first, "\"value\":"));
        TRY(any_value(w, &a, depth));
    }
    if (strindex) {
        TRY(member(b, &first, "\"keyStrindex\":"));
        TRY(put_int32(b, strindex));
    }
    PUT(b, "}");
    if (key_size == 0 || (row == NULL && !resource)) return OK;
    PyObject **slot = NULL;
    KeySlot *name = NULL;
    if (resource) {
        if (same_text(key, key_size, service_text, service_size))
            slot = &w->service;
        else if (same_text(key, key_size, role_text, role_size))
            slot = &w->role;
        else
            return OK;
    } else if ((name = row_key(key, key_size)) == NULL) {
        return OK;
    }
    PyObject *held = scalar(&a, name != NULL && !name->textual);
    if (held == NULL) return FAIL;
    if (slot != NULL) {
        Py_XSETREF(*slot, held);
        return OK;
    }
    int rc = PyDict_SetItem(row, name->key, held);
    Py_DECREF(held);
    return rc < 0 ? FAIL : OK;
}

/* Writes one item of a repeated message field (``rows``: where a span's row goes) */
typedef int (*Item)(Walk *w, const uint8_t *data, size_t size, PyObject *rows);

/* ``name`` (``"spans":[`` and the like), the items of repeated field ``number``, ``]``; no
 * member where there is no item */
static int items(Walk *w, int *first, const char *name, const uint8_t *data, size_t size,
                 uint32_t number, Item item, PyObject *rows) {
    int any = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        if (f.number != number) continue;
        WIRE(f, 2);
        if (any)
            PUT(&w->line, ",");
        else
            TRY(member(&w->line, first, name));
        any = 1;
        TRY(item(w, f.data, f.size, rows));
    }
    if (any) PUT(&w->line, "]");
    return OK;
}

/* A KeyValue as an item: its value into a span's ``row``, or none kept */
static int attribute(Walk *w, const uint8_t *data, size_t size, PyObject *row) {
    return key_value(w, data, size, row, 0, 0);
}

/* A resource's KeyValue as an item: its service and role kept in ``w`` */
static int resource_attribute(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    (void)rows;
    return key_value(w, data, size, NULL, 1, 0);
}

/* ``"attributes":[...]``: the KeyValues of field ``number``, if any */
static int attributes(Walk *w, int *first, const uint8_t *data, size_t size, uint32_t number,
                      Item item, PyObject *row) {
    return items(w, first, "\"attributes\":[", data, size, number, item, row);
}

static int uint32_member(Buf *b, int *first, const char *name, uint32_t v) {
    if (!v) return OK;
    TRY(member(b, first, name));
    return put_u64(b, v);
}

static int string_member(Buf *b, int *first, const char *name, const uint8_t *s, size_t n) {
    if (!n) return OK;
    TRY(member(b, first, name));
    return put_string(b, s, n);
}

static int fixed64_member(Buf *b, int *first, const char *name, uint64_t v) {
    if (!v) return OK;
    TRY(member(b, first, name));
    PUT(b, "\"");
    TRY(put_u64(b, v));
    PUT(b, "\"");
    return OK;
}

static int hex_member(Buf *b, int *first, const char *name, const uint8_t *s, size_t n) {
    if (!n) return OK;
    TRY(member(b, first, name));
    return put_hex(b, s, n);
}

typedef struct {
    const uint8_t *data;
    size_t size;
} Bytes;

/* The scalar fields of an Event, a Link or a Span: last one wins, as protobuf's */
static int bytes_field(Field *f, Bytes *out) {
    WIRE(*f, 2);
    out->data = f->data;
    out->size = f->size;
    return OK;
}

static int string_field(Field *f, Bytes *out) {
    TRY(bytes_field(f, out));
    return valid_utf8(out->data, out->size) ? OK : FALLBACK;
}

static int event(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    (void)rows;
    uint64_t time = 0;
    Bytes name = {0};
    uint32_t dropped = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        switch (f.number) {
            case 1: WIRE(f, 1); time = f.u; break;
            case 2: TRY(string_field(&f, &name)); break;
            case 3: WIRE(f, 2); break;
            case 4: WIRE(f, 0); TRY(as_uint32(f.u, &dropped)); break;
        }
    }
    Buf *b = &w->line;
    int first = 1;
    PUT(b, "{");
    TRY(fixed64_member(b, &first, "\"timeUnixNano\":", time));
    TRY(string_member(b, &first, "\"name\":", name.data, name.size));
    TRY(attributes(w, &first, data, size, 3, attribute, NULL));
    TRY(uint32_member(b, &first, "\"droppedAttributesCount\":", dropped));
    PUT(b, "}");
    return OK;
}

static int span_link(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    (void)rows;
    Bytes trace = {0}, span = {0}, state = {0};
    uint32_t dropped = 0, flags = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        switch (f.number) {
            case 1: TRY(bytes_field(&f, &trace)); break;
            case 2: TRY(bytes_field(&f, &span)); break;
            case 3: TRY(string_field(&f, &state)); break;
            case 4: WIRE(f, 2); break;
            case 5: WIRE(f, 0); TRY(as_uint32(f.u, &dropped)); break;
            case 6: WIRE(f, 5); flags = (uint32_t)f.u; break;
        }
    }
    Buf *b = &w->line;
    int first = 1;
    PUT(b, "{");
    TRY(hex_member(b, &first, "\"traceId\":", trace.data, trace.size));
    TRY(hex_member(b, &first, "\"spanId\":", span.data, span.size));
    TRY(string_member(b, &first, "\"traceState\":", state.data, state.size));
    TRY(attributes(w, &first, data, size, 4, attribute, NULL));
    TRY(uint32_member(b, &first, "\"droppedAttributesCount\":", dropped));
    TRY(uint32_member(b, &first, "\"flags\":", flags));
    PUT(b, "}");
    return OK;
}

/* A row's id: lower-case hex of ``expected`` bytes, None when absent; any other length
 * is hex_id's to judge (the Python path). New reference, or NULL with ``*rc`` set. */
static PyObject *row_id(Bytes *id, size_t expected, int *rc) {
    if (id->size == 0) return Py_NewRef(Py_None);
    if (id->size != expected) {
        *rc = FALLBACK;
        return NULL;
    }
    PyObject *text = PyUnicode_New((Py_ssize_t)(2 * expected), 127);
    if (text == NULL) {
        *rc = FAIL;
        return NULL;
    }
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(text);
    for (size_t i = 0; i < expected; i++) {
        out[2 * i] = (Py_UCS1)HEX[id->data[i] >> 4];
        out[2 * i + 1] = (Py_UCS1)HEX[id->data[i] & 15];
    }
    return text;
}

static int set_column(PyObject *row, int column, PyObject *value) { /* steals value */
    if (value == NULL) return FAIL;
    int rc = PyDict_SetItem(row, columns[column], value);
    Py_DECREF(value);
    return rc < 0 ? FAIL : OK;
}

/* _rows.renamed, then the resource's role where the span names none */
static int rename_and_role(Walk *w, PyObject *row) {
    Py_ssize_t count = PyTuple_GET_SIZE(renamed_pairs);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyTuple_GET_ITEM(renamed_pairs, i);
        PyObject *old = PyTuple_GET_ITEM(pair, 0), *new = PyTuple_GET_ITEM(pair, 1);
        PyObject *value = PyDict_GetItemWithError(row, old);
        if (value == NULL) {
            if (PyErr_Occurred()) return FAIL;
            continue;
        }
        Py_INCREF(value);
        int rc = PyDict_DelItem(row, old);
        if (rc == 0 && PyDict_SetDefault(row, new, value) == NULL) rc = -1;
        Py_DECREF(value);
        if (rc < 0) return FAIL;
    }
    if (w->role != NULL && w->role != Py_None &&
        PyDict_SetDefault(row, role_key, w->role) == NULL)
        return FAIL;
    return OK;
}

static int span(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    Bytes trace = {0}, span_id = {0}, state = {0}, parent = {0}, name = {0};
    int32_t kind = 0, code = 0;
    uint64_t start = 0, end = 0;
    uint32_t dropped_attributes = 0, dropped_events = 0, dropped_links = 0, flags = 0;
    const uint8_t *status = NULL;
    size_t status_size = 0;
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        switch (f.number) {
            case 1: TRY(bytes_field(&f, &trace)); break;
            case 2: TRY(bytes_field(&f, &span_id)); break;
            case 3: TRY(string_field(&f, &state)); break;
            case 4: TRY(bytes_field(&f, &parent)); break;
            case 5: TRY(string_field(&f, &name)); break;
            case 6: WIRE(f, 0); TRY(as_int32(f.u, &kind)); break;
            case 7: WIRE(f, 1); start = f.u; break;
            case 8: WIRE(f, 1); end = f.u; break;
            case 9: WIRE(f, 2); break;
            case 10: WIRE(f, 0); TRY(as_uint32(f.u, &dropped_attributes)); break;
            case 11: WIRE(f, 2); break;
            case 12: WIRE(f, 0); TRY(as_uint32(f.u, &dropped_events)); break;
            case 13: WIRE(f, 2); break;
            case 14: WIRE(f, 0); TRY(as_uint32(f.u, &dropped_links)); break;
            case 15:
                WIRE(f, 2);
                if (status != NULL) return FALLBACK; /* merged by protobuf */
                status = f.data;
                status_size = f.size;
                break;
            case 16: WIRE(f, 5); flags = (uint32_t)f.u; break;
        }
    }
    Bytes message = {0};
    if (status != NULL) {
        FIELDS(status, status_size) {
            Field f;
            NEXT(f);
            if (f.number == 2) {
                TRY(string_field(&f, &message));
            } else if (f.number == 3) {
                WIRE(f, 0);
                TRY(as_int32(f.u, &code));
            }
        }
    }
    Buf *b = &w->line;
    int first = 1;
    PUT(b, "{");
    TRY(hex_member(b, &first, "\"traceId\":", trace.data, trace.size));
    TRY(hex_member(b, &first, "\"spanId\":", span_id.data, span_id.size));
    TRY(string_member(b, &first, "\"traceState\":", state.data, state.size));
    TRY(hex_member(b, &first, "\"parentSpanId\":", parent.data, parent.size));
    TRY(string_member(b, &first, "\"name\":", name.data, name.size));
    if (kind) {
        TRY(member(b, &first, "\"kind\":"));
        TRY(put_enum(b, kind, kind_names));
    }
    TRY(fixed64_member(b, &first, "\"startTimeUnixNano\":", start));
    TRY(fixed64_member(b, &first, "\"endTimeUnixNano\":", end));

    PyObject *row = PyDict_New();
    if (row == NULL) return FAIL;
    int rc = PyList_Append(rows, row) < 0 ? FAIL : OK;
    Py_DECREF(row); /* the list holds it */
    if (rc != OK) return rc;
    TRY(attributes(w, &first, data, size, 9, attribute, row));
    TRY(uint32_member(b, &first, "\"droppedAttributesCount\":", dropped_attributes));
    TRY(items(w, &first, "\"events\":[", data, size, 11, event, NULL));
    TRY(uint32_member(b, &first, "\"droppedEventsCount\":", dropped_events));
    TRY(items(w, &first, "\"links\":[", data, size, 13, span_link, NULL));
    TRY(uint32_member(b, &first, "\"droppedLinksCount\":", dropped_links));
    if (status != NULL) {
        int inner = 1;
        TRY(member(b, &first, "\"status\":{"));
        TRY(string_member(b, &inner, "\"message\":", message.data, message.size));
        if (code) {
            TRY(member(b, &inner, "\"code\":"));
            TRY(put_enum(b, code, code_names));
        }
        PUT(b, "}");
    }
    TRY(uint32_member(b, &first, "\"flags\":", flags));
    PUT(b, "}");

    /* the row, in _rows._otlp_span's order */
    TRY(rename_and_role(w, row));
    rc = OK;
    PyObject *value = row_id(&trace, 16, &rc);
    if (value == NULL) return rc;
    TRY(set_column(row, C_TRACE, value));
    if ((value = row_id(&span_id, 8, &rc)) == NULL) return rc;
    TRY(set_column(row, C_SPAN, value));
    if ((value = row_id(&parent, 8, &rc)) == NULL) return rc;
    TRY(set_column(row, C_PARENT, value));
    value = name.size ? PyUnicode_DecodeUTF8((const char *)name.data, (Py_ssize_t)name.size, NULL)
                      : Py_NewRef(Py_None);
    TRY(set_column(row, C_NAME, value));
    TRY(set_column(row, C_SERVICE, Py_NewRef(w->service ? w->service : Py_None)));
    /* a time as the int its decimal text coerces to (0: absent, None) */
    TRY(set_column(row, C_START, start ? PyLong_FromUnsignedLongLong(start) : Py_NewRef(Py_None)));
    TRY(set_column(row, C_END, end ? PyLong_FromUnsignedLongLong(end) : Py_NewRef(Py_None)));
    TRY(set_column(row, C_ERROR, Py_NewRef(status != NULL && code == 2 ? Py_True : Py_False)));
    return OK;
}

static int scope_spans(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    const uint8_t *scope = NULL;
    size_t scope_size = 0;
    Bytes schema = {0};
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        if (f.number == 1) {
            WIRE(f, 2);
            if (scope != NULL) return FALLBACK;
            scope = f.data;
            scope_size = f.size;
        } else if (f.number == 2) {
            WIRE(f, 2);
        } else if (f.number == 3) {
            TRY(string_field(&f, &schema));
        }
    }
    Buf *b = &w->line;
    int first = 1;
    PUT(b, "{");
    if (scope != NULL) {
        Bytes name = {0}, version = {0};
        uint32_t dropped = 0;
        FIELDS(scope, scope_size) {
            Field f;
            NEXT(f);
            switch (f.number) {
                case 1: TRY(string_field(&f, &name)); break;
                case 2: TRY(string_field(&f, &version)); break;
                case 3: WIRE(f, 2); break;
                case 4: WIRE(f, 0); TRY(as_uint32(f.u, &dropped)); break;
            }
        }
        int inner = 1;
        TRY(member(b, &first, "\"scope\":{"));
        TRY(string_member(b, &inner, "\"name\":", name.data, name.size));
        TRY(string_member(b, &inner, "\"version\":", version.data, version.size));
        TRY(attributes(w, &inner, scope, scope_size, 3, attribute, NULL));
        TRY(uint32_member(b, &inner, "\"droppedAttributesCount\":", dropped));
        PUT(b, "}");
    }
    TRY(items(w, &first, "\"spans\":[", data, size, 2, span, rows));
    TRY(string_member(b, &first, "\"schemaUrl\":", schema.data, schema.size));
    PUT(b, "}");
    return OK;
}

static int resource_spans(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    const uint8_t *resource = NULL;
    size_t resource_size = 0;
    Bytes schema = {0};
    FIELDS(data, size) {
        Field f;
        NEXT(f);
        if (f.number == 1) {
            WIRE(f, 2);
            if (resource != NULL) return FALLBACK;
            resource = f.data;
            resource_size = f.size;
        } else if (f.number == 2) {
            WIRE(f, 2);
        } else if (f.number == 3) {
            TRY(string_field(&f, &schema));
        }
    }
    Py_CLEAR(w->service);
    Py_CLEAR(w->role);
    Buf *b = &w->line;
    int first = 1;
    PUT(b, "{");
    if (resource != NULL) {
        uint32_t dropped = 0;
        FIELDS(resource, resource_size) {
            Field f;
            NEXT(f);
            if (f.number == 1) {
                WIRE(f, 2);
            } else if (f.number == 2) {
                WIRE(f, 0);
                TRY(as_uint32(f.u, &dropped));
            } else if (f.number == 3) {
                return FALLBACK; /* entity refs: the generic mapping's */
            }
        }
        int inner = 1;
        TRY(member(b, &first, "\"resource\":{"));
        TRY(attributes(w, &inner, resource, resource_size, 1, resource_attribute, NULL));
        TRY(uint32_member(b, &inner, "\"droppedAttributesCount\":", dropped));
        PUT(b, "}");
    }
    TRY(items(w, &first, "\"scopeSpans\":[", data, size, 2, scope_spans, rows));
    TRY(string_member(b, &first, "\"schemaUrl\":", schema.data, schema.size));
    PUT(b, "}");
    return OK;
}

static int request(Walk *w, const uint8_t *data, size_t size, PyObject *rows) {
    int first = 1;
    PUT(&w->line, "{");
    TRY(items(w, &first, "\"resourceSpans\":[", data, size, 1, resource_spans, rows));
    PUT(&w->line, "}");
    return OK;
}

/* ------------------------------------------------------------------------ Python */

static PyObject *decode(PyObject *module, PyObject *arg) {
    (void)module;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_otlp_native.configure() was not called");
        return NULL;
    }
    Py_buffer body;
    if (PyObject_GetBuffer(arg, &body, PyBUF_SIMPLE) < 0) return NULL;
    Walk w = {{NULL, 0, 0}, NULL, NULL};
    PyObject *rows = PyList_New(0), *result = NULL;
    int rc = rows == NULL ? FAIL : request(&w, body.buf, (size_t)body.len, rows);
    if (rc == OK) {
        PyObject *line = PyUnicode_DecodeUTF8(w.line.data, (Py_ssize_t)w.line.size, NULL);
        if (line != NULL) result = PyTuple_Pack(2, line, rows);
        Py_XDECREF(line);
    } else if (rc == FALLBACK) {
        result = Py_NewRef(Py_None);
    }
    Py_XDECREF(rows);
    Py_XDECREF(w.service);
    Py_XDECREF(w.role);
    PyMem_Free(w.line.data);
    PyBuffer_Release(&body);
    return result;
}

static int utf8_of(PyObject *text, const char **out, Py_ssize_t *size) {
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "a key must be a str");
        return -1;
    }
    *out = PyUnicode_AsUTF8AndSize(text, size);
    return *out == NULL ? -1 : 0;
}

static int names(PyObject *sequence, Py_ssize_t count, const char *what) {
    if (!PyTuple_Check(sequence) || (count >= 0 && PyTuple_GET_SIZE(sequence) != count)) {
        PyErr_Format(PyExc_ValueError, "%s: a tuple of names", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sequence); i++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(sequence, i))) {
            PyErr_Format(PyExc_TypeError, "%s: names must be str", what);
            return -1;
        }
    }
    return 0;
}

static PyObject *configure(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *keys, *renamed, *role, *service, *column_names, *kinds, *codes;
    if (!PyArg_ParseTuple(args, "OO!UUOOO:configure", &keys, &PyTuple_Type, &renamed, &role,
                          &service, &column_names, &kinds, &codes))
        return NULL;
    configured = 0;
    for (int i = 0; i < KEY_SLOTS; i++) Py_CLEAR(row_keys[i].key);
    if (!PyDict_Check(keys) || PyDict_GET_SIZE(keys) > KEY_SLOTS / 2) {
        PyErr_SetString(PyExc_ValueError, "row_keys: a dict of at most 512 keys");
        return NULL;
    }
    Py_ssize_t position = 0;
    PyObject *key, *textual;
    while (PyDict_Next(keys, &position, &key, &textual)) {
        const char *text;
        Py_ssize_t size;
        if (utf8_of(key, &text, &size) < 0) return NULL;
        int is_text = PyObject_IsTrue(textual);
        if (is_text < 0) return NULL;
        for (uint64_t i = fnv((const uint8_t *)text, (size_t)size);; i++) {
            KeySlot *slot = &row_keys[i & (KEY_SLOTS - 1)];
            if (slot->key == NULL) {
                slot->key = Py_NewRef(key);
                slot->text = text;
                slot->size = size;
                slot->textual = is_text;
                break;
            }
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(renamed); i++) {
        PyObject *pair = PyTuple_GET_ITEM(renamed, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)) ||
            !PyUnicode_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_SetString(PyExc_ValueError, "renamed: a tuple of (old, new) str pairs");
            return NULL;
        }
    }
    Py_XSETREF(renamed_pairs, Py_NewRef(renamed));
    Py_XSETREF(role_key, Py_NewRef(role));
    Py_XSETREF(service_key, Py_NewRef(service));
    if (utf8_of(role_key, &role_text, &role_size) < 0 ||
        utf8_of(service_key, &service_text, &service_size) < 0 ||
        names(column_names, N_COLUMNS, "columns") < 0 || names(kinds, -1, "span kinds") < 0 ||
        names(codes, -1, "status codes") < 0)
        return NULL;
    for (int i = 0; i < N_COLUMNS; i++)
        Py_XSETREF(columns[i], Py_NewRef(PyTuple_GET_ITEM(column_names, i)));
    Py_XSETREF(kind_names, Py_NewRef(kinds));
    Py_XSETREF(code_names, Py_NewRef(codes));
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(row_keys, renamed, role_key, service_key, columns, kind_names, code_names): "
     "row_keys maps each key a row keeps to whether its values are text"},
    {"decode", decode, METH_O,
     "decode(body) -> (line, rows) | None: None where the Python path must decide"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_otlp_native",
    "OTLP/protobuf trace requests to the store's line and span rows (a fast path)", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__otlp_native(void) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    PyErr_SetString(PyExc_ImportError, "_otlp_native reads fixed-width fields little-endian");
    return NULL;
#endif
    text_nan = PyUnicode_InternFromString("NaN");
    text_inf = PyUnicode_InternFromString("Infinity");
    text_minus_inf = PyUnicode_InternFromString("-Infinity");
    if (text_nan == NULL || text_inf == NULL || text_minus_inf == NULL) return NULL;
    return PyModule_Create(&module_def);
}
