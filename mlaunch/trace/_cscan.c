/* The span store's first read in C: OTLP-JSON request lines straight into Arrow buffers.

   ``scan(data, lines, iter_keys, mb_keys, truncated_keys)`` walks the raw bytes of ``lines``
   complete request lines once and fills the columns of the store's span schema (see
   ``mlaunch/trace/store_decode.py``, which wraps them with ``pa.Array.from_buffers``): string
   columns as int32 offsets + data, int64/int8 values, bit-packed booleans and validity bitmaps.
   No Python object is made per span.

   The JSON-text columns are slices of the line: ``attributes`` and ``links`` are copied as
   written, ``events`` with each ``timeUnixNano`` string written as the number it holds (as the
   reader normalises it), ``extra`` composed of the raw ``"key":value`` members of the span that
   have no column. Their text may differ from the reader's in spacing, key order and number
   spelling, never in what it decodes to (store_decode's rule).

   It takes only what it reads exactly: the OTLP span schema store_decode parses with (every
   key known, every value of its type), strict JSON (RFC 8259: no NaN, no leading zeros, UTF-8
   validated, no lone surrogate), no ``null`` anywhere, no escape in an object key, a span id or
   a name, integers within int64, doubles that are finite, and each line one object ending at
   its newline. Anything else and the whole chunk is refused (None): store_decode's pyarrow path,
   then the reader, read it with their own rules and messages. The input is untrusted: every
   read is bounds-checked against the end of the buffer, and nothing is recursive beyond the
   schema's fixed depth. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Memory owned by a Python object and lent through the buffer protocol (pa.py_buffer wraps it
   without a copy; freed when pyarrow drops the last array that uses it). */

typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t len;
} Memory;

static void
memory_dealloc(Memory *m)
{
    free(m->data);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static int
memory_getbuffer(Memory *m, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)m, m->data, m->len, 1, flags);
}

static PyBufferProcs memory_as_buffer = {(getbufferproc)memory_getbuffer, NULL};

static PyTypeObject MemoryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mlaunch.trace._cscan.Memory",
    .tp_doc = "A column buffer scan() filled (read-only, through the buffer protocol).",
    .tp_basicsize = sizeof(Memory),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)memory_dealloc,
    .tp_as_buffer = &memory_as_buffer,
};

/* ------------------------------------------------------------------------------------------ */
/* Growable buffers. */

enum { OK = 0, REFUSE = 1, NOMEM = 2 };
#define TRY(x)                                                                                \
    do {                                                                                      \
        int r_ = (x);                                                                         \
        if (r_ != OK) {                                                                       \
            return r_;                                                                        \
        }                                                                                     \
    } while (0)

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static int
buf_reserve(Buf *b, size_t more)
{
    if (b->len + more <= b->cap) {
        return OK;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) {
        cap *= 2;
    }
    char *q = realloc(b->p, cap);
    if (q == NULL) {
        return NOMEM;
    }
    b->p = q;
    b->cap = cap;
    return OK;
}

static int
buf_put(Buf *b, const void *src, size_t n)
{
    TRY(buf_reserve(b, n));
    memcpy(b->p + b->len, src, n);
    b->len += n;
    return OK;
}

/* The hand-over to Python: the buffer becomes a Memory (NULL, an exception set, on failure;
   the buffer is then freed with the rest). */
static PyObject *
buf_release(Buf *b)
{
    if (b->p == NULL && buf_reserve(b, 8) != OK) {
        return PyErr_NoMemory();
    }
    Memory *m = PyObject_New(Memory, &MemoryType);
    if (m == NULL) {
        return NULL;
    }
    m->data = b->p;
    m->len = (Py_ssize_t)b->len;
    b->p = NULL;
    b->len = b->cap = 0;
    return (PyObject *)m;
}

/* A column: values (int64, int8, bits or string data), int32 offsets for strings, and a
   validity bitmap (1 = a value). */
typedef struct {
    Buf values, offsets, valid;
    size_t nulls;
} Column;

/* Every column has one row per span: ``row`` is the span being written. */
static int
col_valid(Column *c, size_t row, int valid)
{
    if (row % 8 == 0) {
        TRY(buf_reserve(&c->valid, 1));
        c->valid.p[c->valid.len++] = 0;
    }
    if (valid) {
        c->valid.p[row / 8] |= (char)(1u << (row % 8));
    } else {
        c->nulls++;
    }
    return OK;
}

static int
col_end_string(Column *c)
{
    int32_t off = (int32_t)c->values.len;
    return buf_put(&c->offsets, &off, sizeof off);
}

static int
col_string(Column *c, size_t row, const unsigned char *s, size_t n)
{
    TRY(buf_put(&c->values, s, n));
    TRY(col_end_string(c));
    return col_valid(c, row, 1);
}

static int
col_null_string(Column *c, size_t row)
{
    TRY(col_end_string(c));
    return col_valid(c, row, 0);
}

static int
col_int64(Column *c, size_t row, int64_t v, int valid)
{
    TRY(buf_put(&c->values, &v, sizeof v));
    return col_valid(c, row, valid);
}

/* ------------------------------------------------------------------------------------------ */
/* The lexer. ``s[i]`` is read only where ``i < n``. */

typedef struct {
    const unsigned char *s;
    size_t i, n;
} Lex;

typedef struct {
    size_t a, b; /* [a, b) */
} Slice;

#define AT(L, c) ((L)->i < (L)->n && (L)->s[(L)->i] == (c))

static void
ws(Lex *L)
{
    /* A newline ends the line: inside one it is no whitespace of ours. */
    while (L->i < L->n && (L->s[L->i] == ' ' || L->s[L->i] == '\t' || L->s[L->i] == '\r')) {
        L->i++;
    }
}

static int
expect(Lex *L, unsigned char c)
{
    ws(L);
    if (!AT(L, c)) {
        return REFUSE;
    }
    L->i++;
    return OK;
}

/* Bytes that stand for themselves in a JSON string and need no UTF-8 check. */
static unsigned char plain[256];

static void
init_plain(void)
{
    for (int c = 0x20; c < 0x80; c++) {
        plain[c] = 1;
    }
    plain['"'] = plain['\\'] = 0;
}

static int
hex4(const Lex *L, size_t i, unsigned *out)
{
    if (i > L->n || L->n - i < 4) {
        return REFUSE;
    }
    unsigned u = 0;
    for (size_t k = i; k < i + 4; k++) {
        unsigned char c = L->s[k];
        unsigned d;
        if (c >= '0' && c <= '9') {
            d = c - '0';
        } else if (c >= 'a' && c <= 'f') {
            d = c - 'a' + 10;
        } else if (c >= 'A' && c <= 'F') {
            d = c - 'A' + 10;
        } else {
            return REFUSE;
        }
        u = u * 16 + d;
    }
    *out = u;
    return OK;
}

/* The length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlong form, no
   surrogate, nothing above U+10FFFF), 0 when there is none. */
static size_t
utf8_len(const Lex *L, size_t i)
{
    const unsigned char *s = L->s;
    size_t left = L->n - i;
    unsigned char c = s[i];
    unsigned char lo = 0x80, hi = 0xBF;
    size_t k;
    if (c >= 0xC2 && c <= 0xDF) {
        k = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        k = 3;
        if (c == 0xE0) {
            lo = 0xA0;
        } else if (c == 0xED) {
            hi = 0x9F;
        }
    } else if (c >= 0xF0 && c <= 0xF4) {
        k = 4;
        if (c == 0xF0) {
            lo = 0x90;
        } else if (c == 0xF4) {
            hi = 0x8F;
        }
    } else {
        return 0;
    }
    if (left < k || s[i + 1] < lo || s[i + 1] > hi) {
        return 0;
    }
    for (size_t j = 2; j < k; j++) {
        if (s[i + j] < 0x80 || s[i + j] > 0xBF) {
            return 0;
        }
    }
    return k;
}

/* A string at L->i: its content (between the quotes) in *out, whether it holds an escape in
   *escaped; L->i after the closing quote. */
static int
string(Lex *L, Slice *out, int *escaped)
{
    ws(L);
    if (!AT(L, '"')) {
        return REFUSE;
    }
    const unsigned char *s = L->s;
    size_t i = L->i + 1, n = L->n;
    int esc = 0;
    out->a = i;
    for (;;) {
        while (i < n && plain[s[i]]) {
            i++;
        }
        if (i >= n) {
            return REFUSE;
        }
        unsigned char c = s[i];
        if (c == '"') {
            break;
        }
        if (c == '\\') {
            esc = 1;
            if (++i >= n) {
                return REFUSE;
            }
            c = s[i];
            if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' ||
                c == 'r' || c == 't') {
                i++;
                continue;
            }
            unsigned u, u2;
            if (c != 'u' || hex4(L, i + 1, &u) != OK) {
                return REFUSE;
            }
            i += 5;
            if (u >= 0xDC00 && u <= 0xDFFF) {
                return REFUSE; /* a low surrogate alone (the reader's JSON refuses it) */
            }
            if (u >= 0xD800 && u <= 0xDBFF) {
                if (n - i < 2 || s[i] != '\\' || s[i + 1] != 'u' || hex4(L, i + 2, &u2) != OK ||
                    u2 < 0xDC00 || u2 > 0xDFFF) {
                    return REFUSE; /* a high surrogate without its low half */
                }
                i += 6;
            }
            continue;
        }
        if (c < 0x20) {
            return REFUSE; /* a control character must be escaped */
        }
        size_t k = utf8_len(L, i);
        if (k == 0) {
            return REFUSE;
        }
        i += k;
    }
    out->b = i;
    L->i = i + 1;
    *escaped = esc;
    return OK;
}

/* A string that must hold no escape: what is compared or stored as its raw bytes. */
static int
plain_string(Lex *L, Slice *out)
{
    int esc;
    TRY(string(L, out, &esc));
    return esc ? REFUSE : OK;
}

/* A JSON number: its text in *out, whether it is an integer literal (no fraction, no
   exponent) in *integer. Numbers longer than 64 bytes are refused: what their value is
   (infinite? an integer past 64 bits?) depends on the decoder. */
static int
number(Lex *L, Slice *out, int *integer)
{
    ws(L);
    const unsigned char *s = L->s;
    size_t i = L->i, n = L->n;
    out->a = i;
    *integer = 1;
    if (i < n && s[i] == '-') {
        i++;
    }
    if (i >= n || s[i] < '0' || s[i] > '9') {
        return REFUSE;
    }
    if (s[i] == '0') {
        i++;
    } else {
        while (i < n && s[i] >= '0' && s[i] <= '9') {
            i++;
        }
    }
    if (i < n && s[i] == '.') {
        *integer = 0;
        i++;
        if (i >= n || s[i] < '0' || s[i] > '9') {
            return REFUSE;
        }
        while (i < n && s[i] >= '0' && s[i] <= '9') {
            i++;
        }
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        *integer = 0;
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) {
            i++;
        }
        if (i >= n || s[i] < '0' || s[i] > '9') {
            return REFUSE;
        }
        while (i < n && s[i] >= '0' && s[i] <= '9') {
            i++;
        }
    }
    if (i - out->a > 64) {
        return REFUSE;
    }
    out->b = i;
    L->i = i;
    return OK;
}

/* ``-?[0-9]+`` in s[a, b) as an int64 (REFUSE otherwise, or when out of range). */
static int
decimal(const unsigned char *s, size_t a, size_t b, int64_t *out)
{
    int neg = a < b && s[a] == '-';
    if (neg) {
        a++;
    }
    if (a >= b) {
        return REFUSE;
    }
    uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX, u = 0;
    for (size_t i = a; i < b; i++) {
        unsigned d = (unsigned)s[i] - '0';
        if (d > 9 || u > (limit - d) / 10) {
            return REFUSE;
        }
        u = u * 10 + d;
    }
    *out = neg ? (int64_t)(0 - u) : (int64_t)u;
    return OK;
}

/* A number's value as a double (finite: JSON has no others; the reader's decoder refuses a
   literal that overflows). */
static int
number_value(const Lex *L, Slice t, double *out)
{
    char tmp[72];
    size_t len = t.b - t.a; /* at most 64: number() refused longer ones */
    memcpy(tmp, L->s + t.a, len);
    tmp[len] = 0;
    char *end;
    errno = 0;
    double d = strtod(tmp, &end);
    if (end != tmp + len || !isfinite(d)) {
        return REFUSE;
    }
    *out = d;
    return OK;
}

/* An integer member (kind, flags, the dropped counts, a status code). */
static int
integer(Lex *L, int64_t *out)
{
    Slice t;
    int is_int;
    TRY(number(L, &t, &is_int));
    return is_int ? decimal(L->s, t.a, t.b, out) : REFUSE;
}

/* A double member: a finite number. */
static int
double_member(Lex *L, Slice *t, int *is_int)
{
    TRY(number(L, t, is_int));
    if (!*is_int) {
        double d;
        TRY(number_value(L, *t, &d));
    }
    return OK;
}

/* The time strings: ``"<int64>"``; out->a/out->b the quotes' positions (the string's bounds). */
static int
time_string(Lex *L, int64_t *v, Slice *quoted)
{
    Slice t;
    TRY(plain_string(L, &t));
    TRY(decimal(L->s, t.a, t.b, v));
    quoted->a = t.a - 1;
    quoted->b = t.b + 1;
    return OK;
}

/* Object members: a key (no escape), its colon; ``*done`` when the object ends. ``first`` is
   set before the first member. */
static int
member(Lex *L, int *first, Slice *key, int *done)
{
    ws(L);
    if (*first) {
        *first = 0;
        if (AT(L, '}')) {
            L->i++;
            *done = 1;
            return OK;
        }
    } else if (AT(L, ',')) {
        L->i++;
    } else if (AT(L, '}')) {
        L->i++;
        *done = 1;
        return OK;
    } else {
        return REFUSE;
    }
    *done = 0;
    TRY(plain_string(L, key));
    return expect(L, ':');
}

/* Lists: ``*done`` when the list ends. */
static int
element(Lex *L, int *first, int *done)
{
    ws(L);
    if (*first) {
        *first = 0;
        if (!AT(L, '[')) {
            return REFUSE;
        }
        L->i++;
        ws(L);
        if (AT(L, ']')) {
            L->i++;
            *done = 1;
            return OK;
        }
        *done = 0;
        return OK;
    }
    if (AT(L, ',')) {
        L->i++;
        *done = 0;
        return OK;
    }
    if (AT(L, ']')) {
        L->i++;
        *done = 1;
        return OK;
    }
    return REFUSE;
}

/* The keys of an object of the schema. */
typedef struct {
    const char *s;
    size_t len;
} Key;
#define K(text) {text, sizeof(text) - 1}

/* The key among ``names`` (its index); refused when it is another, or one seen before. */
static int
key_index(const Lex *L, Slice key, const Key *names, int count, unsigned *seen, int *index)
{
    size_t len = key.b - key.a;
    for (int k = 0; k < count; k++) {
        if (names[k].len == len && memcmp(L->s + key.a, names[k].s, len) == 0) {
            if (*seen & (1u << k)) {
                return REFUSE; /* a key twice: decoders keep one or the other */
            }
            *seen |= 1u << k;
            *index = k;
            return OK;
        }
    }
    return REFUSE; /* a key outside the schema */
}

/* ------------------------------------------------------------------------------------------ */
/* The schema. */

typedef struct {
    const unsigned char *p;
    size_t len;
} Name;

typedef struct {
    Name iter[4], mb[4], trunc[4];
    int n_iter, n_mb, n_trunc;
} Keys;

static int
is_one_of(const Lex *L, Slice s, const Name *names, int count)
{
    size_t len = s.b - s.a;
    for (int k = 0; k < count; k++) {
        if (names[k].len == len && memcmp(L->s + s.a, names[k].p, len) == 0) {
            return 1;
        }
    }
    return 0;
}

enum { V_NONE, V_STRING, V_BOOL, V_INT, V_DOUBLE };

typedef struct {
    int kind;
    Slice text; /* the string's content, or the number's text */
    int truth;  /* V_BOOL */
    int integer; /* V_DOUBLE: an integer literal */
} Value;

static const Key value_keys[] = {K("stringValue"), K("boolValue"), K("intValue"), K("doubleValue")};

/* An AnyValue of the schema: a scalar, or nothing ({}). */
static int
any_value(Lex *L, Value *v)
{
    TRY(expect(L, '{'));
    int first = 1, done;
    unsigned seen = 0;
    Slice key;
    v->kind = V_NONE;
    for (;;) {
        TRY(member(L, &first, &key, &done));
        if (done) {
            return OK;
        }
        if (v->kind != V_NONE) {
            return REFUSE; /* two kinds in one AnyValue */
        }
        int k;
        TRY(key_index(L, key, value_keys, 4, &seen, &k));
        int esc;
        switch (k) {
        case 0:
            TRY(string(L, &v->text, &esc));
            v->kind = V_STRING;
            break;
        case 1:
            ws(L);
            if (L->n - L->i >= 4 && memcmp(L->s + L->i, "true", 4) == 0) {
                v->truth = 1;
                L->i += 4;
            } else if (L->n - L->i >= 5 && memcmp(L->s + L->i, "false", 5) == 0) {
                v->truth = 0;
                L->i += 5;
            } else {
                return REFUSE;
            }
            v->kind = V_BOOL;
            break;
        case 2:
            TRY(string(L, &v->text, &esc));
            if (esc) {
                v->text.b = v->text.a; /* (only read where a key needs it: refused there) */
                v->kind = -1;
            } else {
                v->kind = V_INT;
            }
            break;
        default:
            TRY(double_member(L, &v->text, &v->integer));
            v->kind = V_DOUBLE;
        }
    }
}

/* What the span's attributes give its columns (``iteration``, ``microbatch``, ``truncated``). */
typedef struct {
    int iter_found, mb_found;
    int64_t iter, mb;
    int iter_valid, mb_valid;
    int truncated;
} Derived;

/* An attribute's value as the int column's (the store's ``_int_attr``: ``intValue``, else a
   ``doubleValue`` truncated toward zero; none for another kind). */
static int
int_of(const Lex *L, const Value *v, int64_t *out, int *valid)
{
    *valid = 0;
    if (v->kind == -1) {
        return REFUSE; /* an escaped intValue */
    }
    if (v->kind == V_INT) {
        TRY(decimal(L->s, v->text.a, v->text.b, out));
        *valid = 1;
    } else if (v->kind == V_DOUBLE) {
        if (v->integer) {
            TRY(decimal(L->s, v->text.a, v->text.b, out));
        } else {
            double d;
            TRY(number_value(L, v->text, &d));
            d = trunc(d);
            if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0)) {
                return REFUSE;
            }
            *out = (int64_t)d;
        }
        *valid = 1;
    }
    return OK;
}

/* Whether the value is true as the reader's ``any_value`` has it (a truncation flag). */
static int
truthy(const Lex *L, const Value *v, int *out)
{
    int64_t i;
    switch (v->kind) {
    case V_STRING:
        *out = v->text.b > v->text.a;
        return OK;
    case V_BOOL:
        *out = v->truth;
        return OK;
    case V_INT:
        TRY(decimal(L->s, v->text.a, v->text.b, &i));
        *out = i != 0;
        return OK;
    case V_DOUBLE: {
        double d;
        TRY(number_value(L, v->text, &d));
        *out = d != 0.0;
        return OK;
    }
    case V_NONE:
        *out = 0;
        return OK;
    default:
        return REFUSE;
    }
}

static const Key kv_keys[] = {K("key"), K("value")};

/* A list of attributes (KeyValue objects); ``d`` the span's, or NULL (resource, scope, event,
   link attributes: copied only). ``*count`` the number of entries. */
static int
attributes(Lex *L, const Keys *keys, Derived *d, size_t *count)
{
    int first = 1, done;
    *count = 0;
    for (;;) {
        TRY(element(L, &first, &done));
        if (done) {
            return OK;
        }
        (*count)++;
        TRY(expect(L, '{'));
        int mfirst = 1, mdone, k;
        unsigned seen = 0;
        Slice key, name = {0, 0};
        int esc = 0;
        Value v;
        v.kind = V_NONE;
        for (;;) {
            TRY(member(L, &mfirst, &key, &mdone));
            if (mdone) {
                break;
            }
            TRY(key_index(L, key, kv_keys, 2, &seen, &k));
            if (k == 0) {
                TRY(string(L, &name, &esc));
            } else {
                TRY(any_value(L, &v));
            }
        }
        if (!(seen & 1)) {
            return REFUSE; /* an attribute without its key */
        }
        if (d == NULL || !(seen & 2)) {
            continue; /* no value: the columns skip it, as the reader does */
        }
        if (esc) {
            return REFUSE; /* an escaped key could spell one the columns read */
        }
        if (!d->iter_found && is_one_of(L, name, keys->iter, keys->n_iter)) {
            d->iter_found = 1;
            TRY(int_of(L, &v, &d->iter, &d->iter_valid));
        }
        if (!d->mb_found && is_one_of(L, name, keys->mb, keys->n_mb)) {
            d->mb_found = 1;
            TRY(int_of(L, &v, &d->mb, &d->mb_valid));
        }
        if (is_one_of(L, name, keys->trunc, keys->n_trunc)) {
            int t;
            TRY(truthy(L, &v, &t));
            d->truncated |= t;
        }
    }
}

/* An object of scalar string/int members and an attribute list: the resource, the scope, a
   link, an event. ``kinds``: 's' a string, 'i' an integer, 'a' attributes, 't' a time string
   (recorded in ``times`` for the events column). */
typedef struct {
    Slice quoted;
    int64_t v;
} Time;

typedef struct {
    const Key *names;
    const char *kinds;
    int count;
    int required; /* the index of a required member, -1 for none */
} Shape;

static int
object(Lex *L, const Shape *shape, const Keys *keys, Buf *times)
{
    TRY(expect(L, '{'));
    int first = 1, done, k;
    unsigned seen = 0;
    Slice key, s;
    for (;;) {
        TRY(member(L, &first, &key, &done));
        if (done) {
            break;
        }
        TRY(key_index(L, key, shape->names, shape->count, &seen, &k));
        int esc;
        int64_t v;
        size_t count;
        switch (shape->kinds[k]) {
        case 's':
            TRY(string(L, &s, &esc));
            break;
        case 'i':
            TRY(integer(L, &v));
            break;
        case 'a':
            TRY(attributes(L, keys, NULL, &count));
            break;
        default: { /* 't' */
            Time t;
            TRY(time_string(L, &t.v, &t.quoted));
            TRY(buf_put(times, &t, sizeof t));
        }
        }
    }
    if (shape->required >= 0 && !(seen & (1u << shape->required))) {
        return REFUSE;
    }
    return OK;
}

static const Key resource_keys[] = {K("attributes"), K("droppedAttributesCount")};
static const Shape resource_shape = {resource_keys, "ai", 2, -1};
static const Key scope_keys[] = {
    K("name"), K("version"), K("attributes"), K("droppedAttributesCount"),
};
static const Shape scope_shape = {scope_keys, "ssai", 4, -1};
static const Key link_keys[] = {
    K("traceId"), K("spanId"), K("traceState"), K("attributes"), K("droppedAttributesCount"),
    K("flags"),
};
static const Shape link_shape = {link_keys, "sssaii", 6, -1};
static const Key event_keys[] = {
    K("timeUnixNano"), K("name"), K("attributes"), K("droppedAttributesCount"),
};
static const Shape event_shape = {event_keys, "tsai", 4, 0};
static const Key status_keys[] = {K("message"), K("code")};

/* A list of objects of one shape; ``*count`` their number. */
static int
object_list(Lex *L, const Shape *shape, const Keys *keys, Buf *times, size_t *count)
{
    int first = 1, done;
    *count = 0;
    for (;;) {
        TRY(element(L, &first, &done));
        if (done) {
            return OK;
        }
        (*count)++;
        TRY(object(L, shape, keys, times));
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Spans into columns. */

enum {
    C_TRACE_ID, C_SPAN_ID, C_PARENT_ID, C_NAME, C_ITERATION, C_MICROBATCH, C_START, C_END,
    C_STATUS, C_TRUNCATED, C_ATTRIBUTES, C_LINKS, C_EVENTS, C_EXTRA, C_ENTRY, C_COUNT
};

typedef struct {
    Lex L;
    const Keys *keys;
    Column col[C_COUNT];
    size_t rows;
    Buf resources; /* per resourceSpans entry: a Slice, a = b = 0 for none */
    Buf times;     /* the current span's event times */
    Buf scratch;   /* the current span's extra members */
} Scan;

enum {
    S_TRACE_ID, S_SPAN_ID, S_TRACE_STATE, S_PARENT, S_FLAGS, S_NAME, S_KIND, S_START, S_END,
    S_ATTRIBUTES, S_DROPPED_ATTRIBUTES, S_EVENTS, S_DROPPED_EVENTS, S_LINKS, S_DROPPED_LINKS,
    S_STATUS, S_COUNT
};
static const Key span_keys[S_COUNT] = {
    K("traceId"), K("spanId"), K("traceState"), K("parentSpanId"), K("flags"), K("name"),
    K("kind"), K("startTimeUnixNano"), K("endTimeUnixNano"), K("attributes"),
    K("droppedAttributesCount"), K("events"), K("droppedEventsCount"), K("links"),
    K("droppedLinksCount"), K("status"),
};

static int
status(Lex *L, int64_t *code)
{
    TRY(expect(L, '{'));
    int first = 1, done, k;
    unsigned seen = 0;
    Slice key, s;
    *code = 0;
    for (;;) {
        TRY(member(L, &first, &key, &done));
        if (done) {
            return OK;
        }
        TRY(key_index(L, key, status_keys, 2, &seen, &k));
        int esc;
        if (k == 0) {
            TRY(string(L, &s, &esc));
        } else {
            TRY(integer(L, code));
        }
    }
}

static int
slice_or_null(Column *c, size_t row, const Lex *L, const Slice *s, size_t count)
{
    if (count == 0) {
        return col_null_string(c, row); /* absent or empty: null, as the reader's columns */
    }
    return col_string(c, row, L->s + s->a, s->b - s->a);
}

/* The events text with each time string written as its number. */
static int
events_text(Scan *S, Column *c, size_t row, Slice s)
{
    const Time *t = (const Time *)S->times.p;
    size_t nt = S->times.len / sizeof(Time), at = s.a;
    for (size_t k = 0; k < nt; k++) {
        TRY(buf_put(&c->values, S->L.s + at, t[k].quoted.a - at));
        char num[24];
        int len = snprintf(num, sizeof num, "%lld", (long long)t[k].v);
        TRY(buf_put(&c->values, num, (size_t)len));
        at = t[k].quoted.b;
    }
    TRY(buf_put(&c->values, S->L.s + at, s.b - at));
    TRY(col_end_string(c));
    return col_valid(c, row, 1);
}

static int
span(Scan *S, int64_t entry)
{
    Lex *L = &S->L;
    TRY(expect(L, '{'));
    int first = 1, done, k;
    unsigned seen = 0;
    Slice key, str[S_COUNT];
    memset(str, 0, sizeof str);
    int64_t start = 0, end = 0, code = 0;
    size_t n_attrs = 0, n_events = 0, n_links = 0;
    Derived d = {0, 0, 0, 0, 0, 0, 0};
    Slice quoted;
    S->times.len = 0;
    S->scratch.len = 0;
    for (;;) {
        TRY(member(L, &first, &key, &done));
        if (done) {
            break;
        }
        TRY(key_index(L, key, span_keys, S_COUNT, &seen, &k));
        size_t from = L->i;
        int esc;
        int64_t v;
        switch (k) {
        case S_TRACE_ID:
        case S_SPAN_ID:
        case S_PARENT:
        case S_NAME:
            TRY(plain_string(L, &str[k]));
            break;
        case S_TRACE_STATE:
            TRY(string(L, &str[k], &esc));
            break;
        case S_START:
            TRY(time_string(L, &start, &quoted));
            break;
        case S_END:
            TRY(time_string(L, &end, &quoted));
            break;
        case S_ATTRIBUTES:
            ws(L);
            from = L->i;
            TRY(attributes(L, S->keys, &d, &n_attrs));
            str[k].a = from;
            str[k].b = L->i;
            break;
        case S_EVENTS:
            ws(L);
            from = L->i;
            TRY(object_list(L, &event_shape, S->keys, &S->times, &n_events));
            str[k].a = from;
            str[k].b = L->i;
            break;
        case S_LINKS:
            ws(L);
            from = L->i;
            TRY(object_list(L, &link_shape, S->keys, &S->times, &n_links));
            str[k].a = from;
            str[k].b = L->i;
            break;
        case S_STATUS:
            TRY(status(L, &code));
            break;
        default: /* flags, kind, the dropped counts */
            TRY(integer(L, &v));
        }
        if (k == S_TRACE_STATE || k == S_FLAGS || k == S_KIND || k == S_DROPPED_ATTRIBUTES ||
            k == S_DROPPED_EVENTS || k == S_DROPPED_LINKS || k == S_STATUS) {
            /* a member of extra: from its key's opening quote to its value's end */
            Slice m = {key.a - 1, L->i};
            TRY(buf_put(&S->scratch, &m, sizeof m));
        }
    }
    unsigned need = (1u << S_NAME) | (1u << S_START) | (1u << S_END);
    if ((seen & need) != need) {
        return REFUSE; /* the reader refuses such a span, with its message */
    }
    size_t row = S->rows;
    Column *c = S->col;
    const unsigned char *s = L->s;
    for (int j = C_TRACE_ID; j <= C_NAME; j++) {
        int kk = j == C_TRACE_ID ? S_TRACE_ID : j == C_SPAN_ID ? S_SPAN_ID
                 : j == C_PARENT_ID ? S_PARENT : S_NAME;
        int present = (seen >> kk) & 1;
        if (present && !(kk == S_PARENT && str[kk].b == str[kk].a)) {
            TRY(col_string(&c[j], row, s + str[kk].a, str[kk].b - str[kk].a));
        } else {
            TRY(col_null_string(&c[j], row)); /* a root's "" parent is null */
        }
    }
    TRY(col_int64(&c[C_ITERATION], row, d.iter_valid ? d.iter : 0, d.iter_valid));
    TRY(col_int64(&c[C_MICROBATCH], row, d.mb_valid ? d.mb : 0, d.mb_valid));
    TRY(col_int64(&c[C_START], row, start, 1));
    TRY(col_int64(&c[C_END], row, end < start ? start : end, 1)); /* an instant span */
    int8_t st = (int8_t)(code == 1 || code == 2 ? code : 0);
    TRY(buf_put(&c[C_STATUS].values, &st, 1));
    TRY(col_valid(&c[C_STATUS], row, 1));
    if (row % 8 == 0) {
        TRY(buf_reserve(&c[C_TRUNCATED].values, 1));
        c[C_TRUNCATED].values.p[c[C_TRUNCATED].values.len++] = 0;
    }
    if (d.truncated) {
        c[C_TRUNCATED].values.p[row / 8] |= (char)(1u << (row % 8));
    }
    TRY(col_valid(&c[C_TRUNCATED], row, 1));
    TRY(slice_or_null(&c[C_ATTRIBUTES], row, L, &str[S_ATTRIBUTES],
                      (seen >> S_ATTRIBUTES) & 1 ? n_attrs : 0));
    TRY(slice_or_null(&c[C_LINKS], row, L, &str[S_LINKS], (seen >> S_LINKS) & 1 ? n_links : 0));
    if ((seen >> S_EVENTS) & 1 && n_events) {
        TRY(events_text(S, &c[C_EVENTS], row, str[S_EVENTS]));
    } else {
        TRY(col_null_string(&c[C_EVENTS], row));
    }
    const Slice *m = (const Slice *)S->scratch.p;
    size_t nm = S->scratch.len / sizeof(Slice);
    if (nm) {
        Column *x = &c[C_EXTRA];
        for (size_t j = 0; j < nm; j++) {
            TRY(buf_put(&x->values, j ? "," : "{", 1));
            TRY(buf_put(&x->values, s + m[j].a, m[j].b - m[j].a));
        }
        TRY(buf_put(&x->values, "}", 1));
        TRY(col_end_string(x));
        TRY(col_valid(x, row, 1));
    } else {
        TRY(col_null_string(&c[C_EXTRA], row));
    }
    TRY(col_int64(&c[C_ENTRY], row, entry, 1));
    S->rows++;
    return OK;
}

static const Key scope_spans_keys[] = {K("scope"), K("spans"), K("schemaUrl")};
static const Key entry_keys[] = {K("resource"), K("scopeSpans"), K("schemaUrl")};

static int
scope_spans(Scan *S, int64_t entry)
{
    Lex *L = &S->L;
    TRY(expect(L, '{'));
    int first = 1, done, k;
    unsigned seen = 0;
    Slice key, s;
    for (;;) {
        TRY(member(L, &first, &key, &done));
        if (done) {
            return OK;
        }
        TRY(key_index(L, key, scope_spans_keys, 3, &seen, &k));
        int esc;
        if (k == 0) {
            TRY(object(L, &scope_shape, S->keys, &S->times));
        } else if (k == 1) {
            int lfirst = 1, ldone;
            for (;;) {
                TRY(element(L, &lfirst, &ldone));
                if (ldone) {
                    break;
                }
                TRY(span(S, entry));
            }
        } else {
            TRY(string(L, &s, &esc));
        }
    }
}

static int
resource_spans_entry(Scan *S)
{
    Lex *L = &S->L;
    int64_t entry = (int64_t)(S->resources.len / sizeof(Slice));
    Slice res = {0, 0};
    TRY(buf_put(&S->resources, &res, sizeof res)); /* filled in below when there is one */
    TRY(expect(L, '{'));
    int first = 1, done, k;
    unsigned seen = 0;
    Slice key, s;
    for (;;) {
        TRY(member(L, &first, &key, &done));
        if (done) {
            return OK;
        }
        TRY(key_index(L, key, entry_keys, 3, &seen, &k));
        int esc;
        if (k == 0) {
            ws(L);
            res.a = L->i;
            TRY(object(L, &resource_shape, S->keys, &S->times));
            res.b = L->i;
            memcpy(S->resources.p + (size_t)entry * sizeof(Slice), &res, sizeof res);
        } else if (k == 1) {
            int lfirst = 1, ldone;
            for (;;) {
                TRY(element(L, &lfirst, &ldone));
                if (ldone) {
                    break;
                }
                TRY(scope_spans(S, entry));
            }
        } else {
            TRY(string(L, &s, &esc));
        }
    }
}

static const Key request_keys[] = {K("resourceSpans")};

static int
scan_lines(Scan *S, Py_ssize_t lines)
{
    Lex *L = &S->L;
    for (Py_ssize_t line = 0; line < lines; line++) {
        TRY(expect(L, '{'));
        int first = 1, done, k;
        unsigned seen = 0;
        Slice key;
        for (;;) {
            TRY(member(L, &first, &key, &done));
            if (done) {
                break;
            }
            TRY(key_index(L, key, request_keys, 1, &seen, &k));
            int lfirst = 1, ldone;
            for (;;) {
                TRY(element(L, &lfirst, &ldone));
                if (ldone) {
                    break;
                }
                TRY(resource_spans_entry(S));
            }
        }
        if (!seen) {
            return REFUSE;
        }
        ws(L);
        if (!AT(L, '\n')) {
            return REFUSE; /* a second object on the line, or a line cut short */
        }
        L->i++;
    }
    return L->i == L->n ? OK : REFUSE;
}

/* ------------------------------------------------------------------------------------------ */
/* The module. */

static void
scan_free(Scan *S)
{
    for (int j = 0; j < C_COUNT; j++) {
        free(S->col[j].values.p);
        free(S->col[j].offsets.p);
        free(S->col[j].valid.p);
    }
    free(S->resources.p);
    free(S->times.p);
    free(S->scratch.p);
}

static int
read_keys(PyObject *t, Name *out, int *count)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) > 4) {
        PyErr_SetString(PyExc_TypeError, "the keys: a tuple of at most 4 bytes");
        return -1;
    }
    *count = (int)PyTuple_GET_SIZE(t);
    for (int k = 0; k < *count; k++) {
        PyObject *b = PyTuple_GET_ITEM(t, k);
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "the keys: a tuple of at most 4 bytes");
            return -1;
        }
        out[k].p = (const unsigned char *)PyBytes_AS_STRING(b);
        out[k].len = (size_t)PyBytes_GET_SIZE(b);
    }
    return 0;
}

/* One column as (validity Memory or None, null count, *buffers). */
static PyObject *
column_tuple(Column *c, int string)
{
    PyObject *valid = NULL, *a = NULL, *b = NULL;
    if (c->nulls) {
        valid = buf_release(&c->valid);
    } else {
        valid = Py_NewRef(Py_None);
    }
    if (valid == NULL) {
        return NULL;
    }
    if (string) {
        a = buf_release(&c->offsets);
        b = a ? buf_release(&c->values) : NULL;
    } else {
        a = buf_release(&c->values);
    }
    if (a == NULL || (string && b == NULL)) {
        Py_DECREF(valid);
        Py_XDECREF(a);
        return NULL;
    }
    PyObject *out = string ? Py_BuildValue("(NnNN)", valid, (Py_ssize_t)c->nulls, a, b)
                           : Py_BuildValue("(NnN)", valid, (Py_ssize_t)c->nulls, a);
    return out;
}

static PyObject *
scan(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer data;
    Py_ssize_t lines;
    PyObject *iter, *mb, *trunc;
    if (!PyArg_ParseTuple(args, "y*nOOO", &data, &lines, &iter, &mb, &trunc)) {
        return NULL;
    }
    Keys keys;
    PyObject *out = NULL;
    Scan S;
    memset(&S, 0, sizeof S);
    if (read_keys(iter, keys.iter, &keys.n_iter) < 0 || read_keys(mb, keys.mb, &keys.n_mb) < 0 ||
        read_keys(trunc, keys.trunc, &keys.n_trunc) < 0) {
        goto done;
    }
    if (data.len >= INT32_MAX || lines < 0) {
        out = Py_NewRef(Py_None); /* offsets are int32: the pyarrow path takes it */
        goto done;
    }
    S.L.s = (const unsigned char *)data.buf;
    S.L.n = (size_t)data.len;
    S.keys = &keys;
    int r = OK;
    for (int j = 0; j < C_COUNT && r == OK; j++) {
        r = col_end_string(&S.col[j]); /* string columns start at offset 0 (others ignore it) */
    }
    if (r == OK) {
        Py_BEGIN_ALLOW_THREADS
        r = scan_lines(&S, lines);
        Py_END_ALLOW_THREADS
    }
    if (r == NOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    if (r == REFUSE) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    size_t entries = S.resources.len / sizeof(Slice);
    PyObject *resources = PyList_New((Py_ssize_t)entries);
    if (resources == NULL) {
        goto done;
    }
    const Slice *res = (const Slice *)S.resources.p;
    for (size_t e = 0; e < entries; e++) {
        PyObject *text;
        if (res[e].b > res[e].a) {
            text = PyUnicode_DecodeUTF8((const char *)S.L.s + res[e].a,
                                        (Py_ssize_t)(res[e].b - res[e].a), "strict");
        } else {
            text = Py_NewRef(Py_None);
        }
        if (text == NULL) {
            Py_DECREF(resources);
            goto done;
        }
        PyList_SET_ITEM(resources, (Py_ssize_t)e, text);
    }
    PyObject *cols = PyTuple_New(C_COUNT);
    if (cols == NULL) {
        Py_DECREF(resources);
        goto done;
    }
    for (int j = 0; j < C_COUNT; j++) {
        int is_string = j == C_TRACE_ID || j == C_SPAN_ID || j == C_PARENT_ID || j == C_NAME ||
                        j == C_ATTRIBUTES || j == C_LINKS || j == C_EVENTS || j == C_EXTRA;
        PyObject *t = column_tuple(&S.col[j], is_string);
        if (t == NULL) {
            Py_DECREF(resources);
            Py_DECREF(cols);
            goto done;
        }
        PyTuple_SET_ITEM(cols, j, t);
    }
    out = Py_BuildValue("(nNN)", (Py_ssize_t)S.rows, resources, cols);
done:
    scan_free(&S);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef module_methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, lines, iter_keys, mb_keys, truncated_keys) -> (spans, resources, columns) or "
     "None: see the module's C source."},
    {NULL},
};

static struct PyModuleDef cscan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mlaunch.trace._cscan",
    .m_doc = "The span store's OTLP-JSON scanner in C (optional; store_decode falls back).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__cscan(void)
{
    init_plain();
    if (PyType_Ready(&MemoryType) < 0) {
        return NULL;
    }
    return PyModule_Create(&cscan_module);
}
