/*
 * Optional C decoder for the kmq marker protocol, versions 1 and 2 (see docs/protocol.md).
 *
 * It implements exactly the rules of the pure-Python decoders (tracker/protocol_v1_decode.py for v1,
 * tracker/protocol_v2.py for v2 range markers), with the same error messages, and builds the
 * same Marker / RangeMarker named tuples; tests/unit/test_protocol.py and
 * tests/unit/test_protocol_v2.py check that they agree on valid, corrupted and random input.
 * When this module is not built, the pure-Python decoders are used; nothing else changes.
 *
 * configure(marker_cls, kinds, error_cls, range_cls, range_kinds) must be called once first.
 *
 * untrack_list(list) is the client's: it takes fetched records out of the cyclic GC's lists
 * while the client holds them (see tracker/client/gc_untrack.py for why and when it is safe).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEAD_SIZE 19
#define MAX_TOPIC 249
#define MAX_GROUP 255
#define MAX_CONSUMER 255
#define MAX_REASON 4096
#define FLAG_HAS_ORIGIN 0x01
#define FLAG_POLICY_DELAY 0x02
#define FLAG_DEFERRED 0x04
#define KNOWN_FLAGS 0x07
#define DELAY_FLAGS (FLAG_POLICY_DELAY | FLAG_DEFERRED)
#define MAX_DELAY_MS 315360000000ULL
#define N_FIELDS 15

static PyTypeObject *marker_type = NULL;
static PyObject *kinds = NULL; /* tuple indexed by the kind byte */
static PyTypeObject *range_type = NULL;
static PyObject *range_kinds = NULL; /* tuple indexed by the v2 kind byte (None: no kind) */
#define V2_HEAD_SIZE 25
#define MAX_RANGE_WIDTH 65536ULL
#define N_RANGE_FIELDS 9
static PyObject *error_cls = NULL;
static PyObject *empty_str = NULL;

/* One-entry caches: a batch mostly repeats the same topic, group and consumer. */
typedef struct {
    char raw[256];
    Py_ssize_t len;
    PyObject *value; /* strong reference, or NULL */
} cache_t;

static cache_t topic_cache[2]; /* [0] topic, [1] origin topic */
static cache_t group_cache;
static cache_t consumer_cache;

static uint16_t rd16(const unsigned char *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static uint32_t rd32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static uint64_t rd64(const unsigned char *p) {
    return ((uint64_t)rd32(p) << 32) | rd32(p + 4);
}

static PyObject *fail(const char *fmt, ...) {
    va_list vargs;
    va_start(vargs, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, vargs);
    va_end(vargs);
    if (msg != NULL) {
        PyErr_SetObject(error_cls, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

static int legal_topic_char(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
}

/* Returns a new reference to the topic str, or NULL with MarkerError set. */
static PyObject *topic_str(cache_t *cache, const unsigned char *p, Py_ssize_t len) {
    if (cache->value != NULL && cache->len == len && memcmp(cache->raw, p, (size_t)len) == 0) {
        Py_INCREF(cache->value);
        return cache->value;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        if (!legal_topic_char(p[i])) {
            if (p[i] < 0x80) {
                PyObject *shown = PyUnicode_DecodeASCII((const char *)p, len > 60 ? 60 : len, "replace");
                if (shown == NULL) return NULL;
                fail("%R is not a legal Kafka topic name", shown);
                Py_DECREF(shown);
                return NULL;
            }
            return fail("topic name is not ASCII");
        }
    }
    if ((len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.')) {
        return fail("'%s' is not a legal Kafka topic name", len == 1 ? "." : "..");
    }
    PyObject *value = PyUnicode_DecodeASCII((const char *)p, len, "strict");
    if (value == NULL) return NULL;
    Py_XDECREF(cache->value);
    memcpy(cache->raw, p, (size_t)len);
    cache->len = len;
    Py_INCREF(value);
    cache->value = value;
    return value;
}

/* UTF-8 text with an optional one-entry cache (len <= 255 when cached). */
static PyObject *text_str(cache_t *cache, const unsigned char *p, Py_ssize_t len, const char *what) {
    if (len == 0) {
        Py_INCREF(empty_str);
        return empty_str;
    }
    if (cache != NULL && cache->value != NULL && cache->len == len &&
        memcmp(cache->raw, p, (size_t)len) == 0) {
        Py_INCREF(cache->value);
        return cache->value;
    }
    /* U+0000 is valid UTF-8 but no PostgreSQL text holds it (tracker/protocol_text.py). */
    if (memchr(p, 0, (size_t)len) != NULL) {
        return fail("%s contains a NUL character (U+0000)", what);
    }
    PyObject *value = PyUnicode_DecodeUTF8((const char *)p, len, "strict");
    if (value == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            return fail("%s is not valid UTF-8", what);
        }
        return NULL;
    }
    if (cache != NULL && len <= 255) {
        Py_XDECREF(cache->value);
        memcpy(cache->raw, p, (size_t)len);
        cache->len = len;
        Py_INCREF(value);
        cache->value = value;
    }
    return value;
}

/* Version 2: a range marker (tracker/protocol_v2.py, py_decode_range_marker). */
static PyObject *decode_v2(const unsigned char *v, Py_ssize_t size) {
    if (size < V2_HEAD_SIZE) return fail("marker of %zd bytes is too short", size);
    int kind = v[1], flags = v[2];
    int32_t partition = (int32_t)rd32(v + 3);
    int64_t first = (int64_t)rd64(v + 7);
    int64_t last = (int64_t)rd64(v + 15);
    Py_ssize_t topic_len = rd16(v + 23);
    if (kind >= PyTuple_GET_SIZE(range_kinds) || PyTuple_GET_ITEM(range_kinds, kind) == Py_None)
        return fail("unknown range marker kind %d", kind);
    if (flags & ~3) return fail("unknown flag bits 0x%02x", flags);
    if (flags == 3) return fail("exceptions cannot be both a bitmap and runs");
    if (partition < 0 || first < 0 || last < 0)
        return fail("partition and offsets must not be negative");
    if (last < first)
        return fail("last offset %lld is before first offset %lld", (long long)last, (long long)first);
    uint64_t width = (uint64_t)last - (uint64_t)first + 1;
    if (width > MAX_RANGE_WIDTH)
        return fail("a range of %llu offsets is wider than %llu", (unsigned long long)width,
                    MAX_RANGE_WIDTH);
    if (topic_len == 0 || topic_len > MAX_TOPIC)
        return fail("topic length %zd is out of range", topic_len);

    PyObject *f[N_RANGE_FIELDS] = {NULL};
    unsigned char *bits = NULL;
    Py_ssize_t pos = V2_HEAD_SIZE + topic_len;
    if (pos + 2 > size) return fail("marker truncated in the topic");
    f[2] = topic_str(&topic_cache[0], v + V2_HEAD_SIZE, topic_len);
    if (f[2] == NULL) goto error;
    Py_ssize_t group_len = rd16(v + pos);
    Py_ssize_t end = pos + 2 + group_len;
    if (end > size || group_len == 0 || group_len > MAX_GROUP) {
        fail("group is empty, too long or truncated");
        goto error;
    }
    f[1] = text_str(&group_cache, v + pos + 2, group_len, "group");
    if (f[1] == NULL) goto error;
    pos = end;

    uint32_t timeout_ms = 0;
    if (kind == 1) { /* RANGE_START */
        if (pos + 6 > size) { fail("RANGE_START marker truncated"); goto error; }
        timeout_ms = rd32(v + pos);
        Py_ssize_t n = rd16(v + pos + 4);
        end = pos + 6 + n;
        if (n > MAX_CONSUMER || end > size) { fail("consumer id too long or truncated"); goto error; }
        f[8] = text_str(&consumer_cache, v + pos + 6, n, "consumer");
        if (f[8] == NULL) goto error;
        pos = end;
    } else if (kind == 4) { /* RANGE_EXTEND */
        if (pos + 4 > size) { fail("RANGE_EXTEND marker truncated"); goto error; }
        timeout_ms = rd32(v + pos);
        if (timeout_ms == 0) { fail("RANGE_EXTEND must ask for a positive timeout"); goto error; }
        pos += 4;
    }

    Py_ssize_t nbytes = (Py_ssize_t)((width + 7) / 8);
    uint64_t set_count = 0;
    if (flags & 1) { /* bitmap */
        if (pos + 4 > size) { fail("exceptions bitmap truncated"); goto error; }
        uint32_t length = rd32(v + pos);
        if ((Py_ssize_t)length != nbytes) {
            fail("exceptions bitmap of %u bytes for a range of %llu offsets (must be %zd)",
                 (unsigned)length, (unsigned long long)width, nbytes);
            goto error;
        }
        pos += 4;
        if (pos + nbytes > size) { fail("exceptions bitmap truncated"); goto error; }
        const unsigned char *b = v + pos;
        unsigned tail_bits = (unsigned)(width % 8);
        if (tail_bits && (b[nbytes - 1] >> tail_bits)) {
            fail("exceptions bitmap has bits set beyond the range");
            goto error;
        }
        for (Py_ssize_t i = 0; i < nbytes; i++) set_count += (uint64_t)__builtin_popcount(b[i]);
        if (set_count == 0) {
            fail("exceptions bitmap is empty (leave the flag unset instead)");
            goto error;
        }
        f[6] = _PyLong_FromByteArray(b, (size_t)nbytes, 1, 0);
        if (f[6] == NULL) goto error;
        pos += nbytes;
    } else if (flags & 2) { /* runs */
        if (pos + 2 > size) { fail("exceptions runs truncated"); goto error; }
        Py_ssize_t count = rd16(v + pos);
        pos += 2;
        if (count == 0) {
            fail("exceptions runs are empty (leave the flag unset instead)");
            goto error;
        }
        if (pos + 8 * count > size) { fail("exceptions runs truncated"); goto error; }
        bits = (unsigned char *)PyMem_Calloc((size_t)nbytes, 1);
        if (bits == NULL) { PyErr_NoMemory(); goto error; }
        int64_t previous_end = -1;
        for (Py_ssize_t r = 0; r < count; r++) {
            uint64_t start = rd32(v + pos), length = rd32(v + pos + 4);
            pos += 8;
            if (length == 0) { fail("an exceptions run has length 0"); goto error; }
            if ((int64_t)start <= previous_end) {
                fail("exceptions runs overlap, touch or are out of order");
                goto error;
            }
            if (start + length > width) { fail("an exceptions run reaches beyond the range"); goto error; }
            for (uint64_t i = start; i < start + length; i++) bits[i >> 3] |= (unsigned char)(1u << (i & 7));
            set_count += length;
            previous_end = (int64_t)(start + length);
        }
        f[6] = _PyLong_FromByteArray(bits, (size_t)nbytes, 1, 0);
        if (f[6] == NULL) goto error;
    }
    if (set_count == width) {
        fail("the exceptions cover the whole range: the marker covers no offset");
        goto error;
    }
    if (pos != size) {
        fail("%zd unexpected trailing bytes", size - pos);
        goto error;
    }
    f[0] = PyTuple_GET_ITEM(range_kinds, kind);
    Py_INCREF(f[0]);
    f[3] = PyLong_FromLong(partition);
    f[4] = PyLong_FromLongLong(first);
    f[5] = PyLong_FromLongLong(last);
    if (f[6] == NULL) f[6] = PyLong_FromLong(0);
    f[7] = PyLong_FromUnsignedLong(timeout_ms);
    if (f[8] == NULL) { Py_INCREF(empty_str); f[8] = empty_str; }
    for (int i = 0; i < N_RANGE_FIELDS; i++) {
        if (f[i] == NULL) goto error;
    }
    PyMem_Free(bits);
    PyObject *marker = range_type->tp_alloc(range_type, N_RANGE_FIELDS);
    if (marker == NULL) {
        for (int i = 0; i < N_RANGE_FIELDS; i++) Py_DECREF(f[i]);
        return NULL;
    }
    for (int i = 0; i < N_RANGE_FIELDS; i++) PyTuple_SET_ITEM(marker, i, f[i]);
    PyObject_GC_UnTrack(marker);
    return marker;

error:
    PyMem_Free(bits);
    for (int i = 0; i < N_RANGE_FIELDS; i++) Py_XDECREF(f[i]);
    return NULL;
}

static PyObject *decode(PyObject *module, PyObject *arg) {
    (void)module;
    if (marker_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_speedups.configure() was not called");
        return NULL;
    }
    if (!PyBytes_Check(arg)) {
        return fail("a marker record must have a bytes value (got a tombstone?)");
    }
    const unsigned char *v = (const unsigned char *)PyBytes_AS_STRING(arg);
    Py_ssize_t size = PyBytes_GET_SIZE(arg);
    if (size && v[0] == 2 && range_type != NULL) return decode_v2(v, size);
    if (size < HEAD_SIZE + 3) {
        if (size && v[0] != 1) return fail("unsupported marker version %d", (int)v[0]);
        return fail("marker of %zd bytes is too short", size);
    }
    int version = v[0], kind = v[1], flags = v[2];
    unsigned attempt = rd16(v + 3);
    int32_t partition = (int32_t)rd32(v + 5);
    int64_t offset = (int64_t)rd64(v + 9);
    Py_ssize_t topic_len = rd16(v + 17);
    if (version != 1) return fail("unsupported marker version %d", version);
    if (kind < 1 || kind > 5) return fail("unknown marker kind %d", kind);
    if (flags & ~KNOWN_FLAGS) return fail("unknown flag bits 0x%02x", flags);
    if (attempt == 0) return fail("attempt must be >= 1");
    if (partition < 0 || offset < 0) return fail("partition and offset must not be negative");
    if (topic_len == 0 || topic_len > MAX_TOPIC)
        return fail("topic length %zd is out of range", topic_len);

    PyObject *f[N_FIELDS] = {NULL};
    Py_ssize_t pos = HEAD_SIZE + topic_len;
    if (pos + 2 > size) return fail("marker truncated in the topic");
    f[2] = topic_str(&topic_cache[0], v + HEAD_SIZE, topic_len);
    if (f[2] == NULL) goto error;
    Py_ssize_t group_len = rd16(v + pos);
    Py_ssize_t end = pos + 2 + group_len;
    if (end > size || group_len == 0 || group_len > MAX_GROUP) {
        fail("group is empty, too long or truncated");
        goto error;
    }
    f[1] = text_str(&group_cache, v + pos + 2, group_len, "group");
    if (f[1] == NULL) goto error;
    pos = end;

    int32_t origin_partition = partition;
    int64_t origin_offset = offset;
    if (flags & FLAG_HAS_ORIGIN) {
        if (pos + 14 > size) { fail("marker truncated in the origin"); goto error; }
        origin_partition = (int32_t)rd32(v + pos);
        origin_offset = (int64_t)rd64(v + pos + 4);
        Py_ssize_t origin_len = rd16(v + pos + 12);
        if (origin_partition < 0 || origin_offset < 0) {
            fail("origin partition and offset must not be negative");
            goto error;
        }
        if (origin_len == 0 || origin_len > MAX_TOPIC) {
            fail("origin topic length %zd is out of range", origin_len);
            goto error;
        }
        pos += 14;
        end = pos + origin_len;
        if (end > size) { fail("marker truncated in the origin topic"); goto error; }
        f[6] = topic_str(&topic_cache[1], v + pos, origin_len);
        if (f[6] == NULL) goto error;
        pos = end;
        if (origin_offset == offset && origin_partition == partition &&
            origin_len == topic_len && memcmp(v + HEAD_SIZE, v + pos - origin_len, (size_t)topic_len) == 0) {
            fail("origin flag set but the origin equals the message");
            goto error;
        }
    } else if (attempt != 1) {
        fail("a redelivered copy (attempt > 1) must name its origin");
        goto error;
    } else {
        Py_INCREF(f[2]);
        f[6] = f[2];
    }

    uint64_t timeout_ms = 0, delay_ms = 0;
    int policy_delay = 0, deferred = 0;
    Py_ssize_t n;
    if (kind != 3 && (flags & DELAY_FLAGS)) {
        fail("the policy-delay and deferred flags are only valid on DELAY markers");
        goto error;
    }
    switch (kind) {
    case 2: /* ACK */
        break;
    case 1: /* START */
        if (pos + 6 > size) { fail("START marker truncated"); goto error; }
        timeout_ms = rd32(v + pos);
        n = rd16(v + pos + 4);
        end = pos + 6 + n;
        if (n > MAX_CONSUMER || end > size) { fail("consumer id too long or truncated"); goto error; }
        f[12] = text_str(&consumer_cache, v + pos + 6, n, "consumer");
        if (f[12] == NULL) goto error;
        pos = end;
        break;
    case 3: /* DELAY */
        if (pos + 10 > size) { fail("DELAY marker truncated"); goto error; }
        delay_ms = rd64(v + pos);
        if (delay_ms > MAX_DELAY_MS) {
            fail("delay of %llu ms is beyond the protocol's limit", (unsigned long long)delay_ms);
            goto error;
        }
        policy_delay = (flags & FLAG_POLICY_DELAY) != 0;
        deferred = (flags & FLAG_DEFERRED) != 0;
        if (policy_delay && delay_ms) { fail("a policy DELAY must carry delay_ms=0"); goto error; }
        if (policy_delay && deferred) {
            fail("a deferred DELAY cannot leave its delay to the policy");
            goto error;
        }
        n = rd16(v + pos + 8);
        end = pos + 10 + n;
        if (n > MAX_REASON || end > size) { fail("DELAY marker reason too long or truncated"); goto error; }
        f[13] = text_str(NULL, v + pos + 10, n, "reason");
        if (f[13] == NULL) goto error;
        pos = end;
        break;
    case 4: /* EXTEND */
        if (pos + 4 > size) { fail("EXTEND marker truncated"); goto error; }
        timeout_ms = rd32(v + pos);
        if (timeout_ms == 0) { fail("EXTEND must ask for a positive timeout"); goto error; }
        pos += 4;
        break;
    default: /* 5: REJECT */
        if (pos + 2 > size) { fail("REJECT marker truncated"); goto error; }
        n = rd16(v + pos);
        end = pos + 2 + n;
        if (n > MAX_REASON || end > size) { fail("REJECT marker reason too long or truncated"); goto error; }
        f[13] = text_str(NULL, v + pos + 2, n, "reason");
        if (f[13] == NULL) goto error;
        pos = end;
        break;
    }
    if (pos != size) {
        fail("%zd unexpected trailing bytes", size - pos);
        goto error;
    }

    f[0] = PyTuple_GET_ITEM(kinds, kind);
    Py_INCREF(f[0]);
    f[3] = PyLong_FromLong(partition);
    f[4] = PyLong_FromLongLong(offset);
    f[5] = PyLong_FromUnsignedLong(attempt);
    f[7] = PyLong_FromLong(origin_partition);
    f[8] = PyLong_FromLongLong(origin_offset);
    f[9] = PyLong_FromUnsignedLongLong(timeout_ms);
    f[10] = PyLong_FromUnsignedLongLong(delay_ms);
    f[11] = policy_delay ? Py_True : Py_False;
    Py_INCREF(f[11]);
    if (f[12] == NULL) { Py_INCREF(empty_str); f[12] = empty_str; }
    if (f[13] == NULL) { Py_INCREF(empty_str); f[13] = empty_str; }
    f[14] = deferred ? Py_True : Py_False;
    Py_INCREF(f[14]);
    for (int i = 0; i < N_FIELDS; i++) {
        if (f[i] == NULL) goto error;
    }
    PyObject *marker = marker_type->tp_alloc(marker_type, N_FIELDS);
    if (marker == NULL) goto error;
    for (int i = 0; i < N_FIELDS; i++) {
        PyTuple_SET_ITEM(marker, i, f[i]); /* steals the reference */
    }
    /* Only str, int, bool and enum members inside: no cycles possible, so keep it out of the
     * cyclic GC's way (CPython would untrack such a tuple at its first collection anyway). */
    PyObject_GC_UnTrack(marker);
    return marker;

error:
    for (int i = 0; i < N_FIELDS; i++) {
        Py_XDECREF(f[i]);
    }
    return NULL;
}

/* Decodes one record value. A refused value is appended to `errors` as (i, message) and
 * *refused is set; NULL without *refused is a real error (out of memory, ...). A refused
 * value costs no exception object: its message is taken as the error was set (with 50 %
 * garbage on the markers topic, building and catching one MarkerError per refused record
 * was a quarter of the ingest loop). */
static PyObject *decode_or_refuse(PyObject *module, PyObject *item, Py_ssize_t i, PyObject *errors,
                                  int *refused) {
    PyObject *marker;
    *refused = 0;
    if (PyByteArray_Check(item) || PyMemoryView_Check(item)) {
        PyObject *copy = PyBytes_FromObject(item); /* as decode_marker does */
        if (copy == NULL) return NULL;
        marker = decode(module, copy);
        Py_DECREF(copy);
    } else {
        marker = decode(module, item);
    }
    if (marker != NULL) return marker;
    if (error_cls == NULL || !PyErr_ExceptionMatches(error_cls)) return NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *message;
    if (value != NULL && PyUnicode_Check(value)) {
        message = value;
        Py_INCREF(message);
    } else if (value != NULL) {
        message = PyObject_Str(value);
    } else {
        message = PyUnicode_FromString("malformed marker");
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (message == NULL) return NULL;
    PyObject *pair = Py_BuildValue("(nN)", i, message); /* steals message */
    if (pair == NULL) return NULL;
    int appended = PyList_Append(errors, pair);
    Py_DECREF(pair);
    if (appended < 0) return NULL;
    *refused = 1;
    return NULL;
}

/* decode_many(values) -> (markers, errors): markers[i] is the Marker of values[i] or None;
 * errors lists (i, message) for each refused value. */
static PyObject *decode_many(PyObject *module, PyObject *values) {
    PyObject *seq = PySequence_Fast(values, "decode_many() needs a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *markers = PyList_New(n);
    PyObject *errors = PyList_New(0);
    if (markers == NULL || errors == NULL) goto failed;
    for (Py_ssize_t i = 0; i < n; i++) {
        int refused;
        PyObject *marker = decode_or_refuse(module, items[i], i, errors, &refused);
        if (marker == NULL) {
            if (!refused) goto failed;
            Py_INCREF(Py_None);
            marker = Py_None;
        }
        PyList_SET_ITEM(markers, i, marker);
    }
    Py_DECREF(seq);
    return Py_BuildValue("(NN)", markers, errors); /* steals both */

failed:
    Py_DECREF(seq);
    Py_XDECREF(markers);
    Py_XDECREF(errors);
    return NULL;
}

/* ---------------------------------------------------------------------------------------
 * sort_records(records, markers_partition, now_ms, pending_cls)
 *     -> (accepted, errors, wheres, samples, where_of)
 *
 * Ingest's per-record work for one markers partition's fetched records, in one pass
 * (tracker/engine/record_decoding.py has the Python twin and says why): decode each
 * record's value; a refused one goes to `errors` as (record index, message); every other
 * becomes a PendingMarker (`pending_cls`, a tuple subclass: marker, ref_ms, markers_partition,
 * markers_offset) in `accepted`, its ref_ms the record's timestamp clamped to [0, now_ms]
 * (an unknown or future timestamp counts as now_ms). No object is made per record beyond the
 * marker and its PendingMarker: the partition, offset and timestamp ints are the ones given.
 *
 * `wheres` lists each distinct (topic, partition, origin_topic, origin_partition) of the
 * accepted markers in the order first seen, `samples` the first marker with each, and
 * `where_of` (bytes, native int32 per accepted marker) the index of its where: the caller
 * checks each where once, and looks at `where_of` only if one is refused. */

static PyObject *attr_value = NULL, *attr_timestamp = NULL, *attr_offset = NULL;

static PyObject *sort_records(PyObject *module, PyObject *args) {
    PyObject *records, *partition_obj, *now_obj;
    PyTypeObject *pending_cls;
    if (!PyArg_ParseTuple(args, "OO!O!O!", &records, &PyLong_Type, &partition_obj, &PyLong_Type,
                          &now_obj, &PyType_Type, &pending_cls)) {
        return NULL;
    }
    if (marker_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_speedups.configure() was not called");
        return NULL;
    }
    if (!PyType_IsSubtype(pending_cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "sort_records: pending_cls must be a tuple subclass");
        return NULL;
    }
    long long now = PyLong_AsLongLong(now_obj);
    if (now == -1 && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(records, "sort_records() needs a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *accepted = PyList_New(n);
    PyObject *errors = PyList_New(0);
    PyObject *wheres = PyList_New(0);
    PyObject *samples = PyList_New(0);
    PyObject *index = PyDict_New();
    PyObject *where_of = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    PyObject *result = NULL;
    Py_ssize_t count = 0;
    if (accepted == NULL || errors == NULL || wheres == NULL || samples == NULL || index == NULL ||
        where_of == NULL) {
        goto done;
    }
    int32_t *where_ids = (int32_t *)PyBytes_AS_STRING(where_of);
    /* The last where seen (borrowed from its key tuple in `wheres`, which keeps them alive). */
    PyObject *last_topic = NULL, *last_origin = NULL;
    long last_partition = -1, last_origin_partition = -1;
    int32_t last_id = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = items[i];
        PyObject *value = PyObject_GetAttr(record, attr_value);
        if (value == NULL) goto done;
        int refused;
        PyObject *marker = decode_or_refuse(module, value, i, errors, &refused);
        Py_DECREF(value);
        if (marker == NULL) {
            if (refused) continue;
            goto done;
        }
        PyObject *topic = PyTuple_GET_ITEM(marker, 2);
        PyObject *partition = PyTuple_GET_ITEM(marker, 3);
        PyObject *origin = topic, *origin_partition = partition;
        if (Py_TYPE(marker) != range_type) {
            origin = PyTuple_GET_ITEM(marker, 6);
            origin_partition = PyTuple_GET_ITEM(marker, 7);
        }
        long p = PyLong_AsLong(partition), op = PyLong_AsLong(origin_partition);
        if (!(topic == last_topic && origin == last_origin && p == last_partition &&
              op == last_origin_partition)) {
            PyObject *key = PyTuple_Pack(4, topic, partition, origin, origin_partition);
            if (key == NULL) { Py_DECREF(marker); goto done; }
            PyObject *found = PyDict_GetItemWithError(index, key); /* borrowed */
            if (found != NULL) {
                last_id = (int32_t)PyLong_AsLong(found);
                /* Point at the stored key's strs, which outlive this loop. */
                PyObject *stored = PyList_GET_ITEM(wheres, last_id);
                last_topic = PyTuple_GET_ITEM(stored, 0);
                last_origin = PyTuple_GET_ITEM(stored, 2);
                Py_DECREF(key);
            } else if (PyErr_Occurred()) {
                Py_DECREF(key);
                Py_DECREF(marker);
                goto done;
            } else {
                PyObject *id = PyLong_FromSsize_t(PyList_GET_SIZE(wheres));
                int bad = id == NULL || PyDict_SetItem(index, key, id) < 0 ||
                          PyList_Append(wheres, key) < 0 || PyList_Append(samples, marker) < 0;
                Py_XDECREF(id);
                Py_DECREF(key);
                if (bad) { Py_DECREF(marker); goto done; }
                last_id = (int32_t)(PyList_GET_SIZE(wheres) - 1);
                last_topic = topic; /* kept alive by the key in `wheres` */
                last_origin = origin;
            }
            last_partition = p;
            last_origin_partition = op;
        }
        PyObject *timestamp = PyObject_GetAttr(record, attr_timestamp);
        if (timestamp == NULL) { Py_DECREF(marker); goto done; }
        long long ts = PyLong_AsLongLong(timestamp);
        if (ts == -1 && PyErr_Occurred()) { Py_DECREF(timestamp); Py_DECREF(marker); goto done; }
        if (ts < 0 || ts > now) {
            /* Durations never count from the future: a writer whose clock runs ahead must
             * not make the tracker redeliver early. */
            Py_DECREF(timestamp);
            Py_INCREF(now_obj);
            timestamp = now_obj;
        }
        PyObject *offset = PyObject_GetAttr(record, attr_offset);
        if (offset == NULL) { Py_DECREF(timestamp); Py_DECREF(marker); goto done; }
        PyObject *pending = pending_cls->tp_alloc(pending_cls, 4);
        if (pending == NULL) {
            Py_DECREF(offset);
            Py_DECREF(timestamp);
            Py_DECREF(marker);
            goto done;
        }
        Py_INCREF(partition_obj);
        PyTuple_SET_ITEM(pending, 0, marker); /* steals the references */
        PyTuple_SET_ITEM(pending, 1, timestamp);
        PyTuple_SET_ITEM(pending, 2, partition_obj);
        PyTuple_SET_ITEM(pending, 3, offset);
        /* A marker tuple and ints: no cycle possible (as for the markers themselves). */
        PyObject_GC_UnTrack(pending);
        PyList_SET_ITEM(accepted, count, pending);
        where_ids[count] = last_id;
        count++;
    }
    if (PyList_SetSlice(accepted, count, n, NULL) < 0) goto done;
    if (count < n && _PyBytes_Resize(&where_of, count * (Py_ssize_t)sizeof(int32_t)) < 0) goto done;
    result = PyTuple_Pack(5, accepted, errors, wheres, samples, where_of);

done:
    /* On failure the list's items past `count` are NULL, which a list frees fine. */
    Py_XDECREF(accepted);
    Py_XDECREF(errors);
    Py_XDECREF(wheres);
    Py_XDECREF(samples);
    Py_XDECREF(index);
    Py_XDECREF(where_of);
    Py_DECREF(seq);
    return result;
}

/* ---------------------------------------------------------------------------------------
 * marker_columns(markers) -> the decoded markers as column buffers, one row per message.
 *
 * `markers` is what decode_many returned: Marker and RangeMarker tuples, None for a refused
 * value. A RangeMarker becomes one row per covered offset, as tracker.protocol.expand_range
 * makes it (a START / ACK / EXTEND of attempt 1 with the range's lease and consumer), so a
 * reader that works per message (the Spark ledger) sees v1 and v2 traffic alike; None stays
 * one row with every field null. The buffers are laid out as Arrow wants them (little-endian
 * values, LSB-first validity bits, int32 string offsets), so pipeline/marker_batches.py wraps them in
 * Arrow arrays without a Python object per row. Returned tuple:
 *   (rows, index, validity, kind, partition, offset, attempt, origin_partition,
 *    origin_offset, timeout_ms, delay_ms, policy_delay, deferred,
 *    group, topic, origin_topic, consumer, reason)
 * where index (int32) is the position in `markers` each row came from, kind is int8 (the
 * MarkerKind value, 0 when null), booleans are one byte each, and every string column is an
 * (offsets, data) pair of bytes. */

typedef struct {
    char *offsets; /* int32[rows + 1] */
    char *data;
    Py_ssize_t used;
} strcol_t;

#define N_STR_COLS 5 /* group, topic, origin_topic, consumer, reason */

static int utf8_of(PyObject *text, const char **out, Py_ssize_t *len) {
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "marker_columns: a text field is not a str");
        return -1;
    }
    *out = PyUnicode_AsUTF8AndSize(text, len);
    return *out == NULL ? -1 : 0;
}

static int64_t as_int64(PyObject *value, int *bad) {
    int64_t out = (int64_t)PyLong_AsLongLong(value);
    if (out == -1 && PyErr_Occurred()) *bad = 1;
    return out;
}

/* The covered offsets of a range as a little-endian bitmap of `width` bits (new memory). */
static unsigned char *range_covered(PyObject *marker, uint64_t width) {
    size_t nbytes = (size_t)((width + 7) / 8);
    unsigned char *bits = (unsigned char *)PyMem_Malloc(nbytes ? nbytes : 1);
    if (bits == NULL) { PyErr_NoMemory(); return NULL; }
    PyObject *exceptions = PyTuple_GET_ITEM(marker, 6);
    if (!PyLong_Check(exceptions) || _PyLong_Sign(exceptions) < 0 ||
        _PyLong_NumBits(exceptions) > width) {
        PyMem_Free(bits);
        PyErr_SetString(PyExc_ValueError, "marker_columns: exceptions outside the range");
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030D0000
    if (_PyLong_AsByteArray((PyLongObject *)exceptions, bits, nbytes, 1, 0, 1) < 0) {
#else
    if (_PyLong_AsByteArray((PyLongObject *)exceptions, bits, nbytes, 1, 0) < 0) {
#endif
        PyMem_Free(bits);
        return NULL;
    }
    for (size_t i = 0; i < nbytes; i++) bits[i] = (unsigned char)~bits[i];
    unsigned tail = (unsigned)(width % 8);
    if (tail) bits[nbytes - 1] &= (unsigned char)((1u << tail) - 1);
    return bits;
}

static PyObject *marker_columns(PyObject *module, PyObject *arg) {
    (void)module;
    if (marker_type == NULL || range_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_speedups.configure() was not called");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "marker_columns() needs a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL;
    PyObject *bufs[13 + 2 * N_STR_COLS] = {NULL};
    strcol_t str[N_STR_COLS];
    memset(str, 0, sizeof str);

    /* Pass 1: how many rows and how many bytes of text. */
    Py_ssize_t rows = 0;
    Py_ssize_t text[N_STR_COLS] = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = items[i];
        const char *p;
        Py_ssize_t len;
        if (m == Py_None) { rows++; continue; }
        if (Py_TYPE(m) == range_type) {
            uint64_t first = (uint64_t)PyLong_AsLongLong(PyTuple_GET_ITEM(m, 4));
            uint64_t last = (uint64_t)PyLong_AsLongLong(PyTuple_GET_ITEM(m, 5));
            if (PyErr_Occurred()) goto done;
            if (last < first || last - first >= MAX_RANGE_WIDTH) {
                PyErr_SetString(PyExc_ValueError, "marker_columns: a range of a bad width");
                goto done;
            }
            uint64_t width = last - first + 1;
            unsigned char *covered = range_covered(m, width);
            if (covered == NULL) goto done;
            Py_ssize_t count = 0;
            for (uint64_t b = 0; b < (width + 7) / 8; b++) count += __builtin_popcount(covered[b]);
            PyMem_Free(covered);
            if (count == 0) { /* the decoder refuses it; rows must not be empty per marker */
                PyErr_SetString(PyExc_ValueError, "marker_columns: a range that covers no offset");
                goto done;
            }
            rows += count;
            if (utf8_of(PyTuple_GET_ITEM(m, 1), &p, &len) < 0) goto done;
            text[0] += len * count;
            if (utf8_of(PyTuple_GET_ITEM(m, 2), &p, &len) < 0) goto done;
            text[1] += len * count;
            text[2] += len * count;
            if (utf8_of(PyTuple_GET_ITEM(m, 8), &p, &len) < 0) goto done;
            text[3] += len * count;
            continue;
        }
        if (Py_TYPE(m) != marker_type) {
            PyErr_SetString(PyExc_TypeError, "marker_columns: not a Marker, RangeMarker or None");
            goto done;
        }
        rows++;
        static const int fields[N_STR_COLS] = {1, 2, 6, 12, 13};
        for (int c = 0; c < N_STR_COLS; c++) {
            if (utf8_of(PyTuple_GET_ITEM(m, fields[c]), &p, &len) < 0) goto done;
            text[c] += len;
        }
    }
    if (rows >= INT32_MAX || n >= INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "marker_columns: too many rows for one batch");
        goto done;
    }
    for (int c = 0; c < N_STR_COLS; c++) {
        if (text[c] >= INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "marker_columns: too much text for one batch");
            goto done;
        }
    }

    /* Pass 2: fill. */
    static const Py_ssize_t widths[13] = {0, 4, 0, 1, 4, 8, 4, 4, 8, 8, 8, 1, 1};
    Py_ssize_t vbytes = (rows + 7) / 8;
    for (int b = 1; b < 13; b++) {
        bufs[b] = PyBytes_FromStringAndSize(NULL, b == 2 ? (vbytes ? vbytes : 1) : widths[b] * rows);
        if (bufs[b] == NULL) goto done;
    }
    for (int c = 0; c < N_STR_COLS; c++) {
        bufs[13 + 2 * c] = PyBytes_FromStringAndSize(NULL, 4 * (rows + 1));
        bufs[14 + 2 * c] = PyBytes_FromStringAndSize(NULL, text[c]);
        if (bufs[13 + 2 * c] == NULL || bufs[14 + 2 * c] == NULL) goto done;
        str[c].offsets = PyBytes_AS_STRING(bufs[13 + 2 * c]);
        str[c].data = PyBytes_AS_STRING(bufs[14 + 2 * c]);
        memset(str[c].offsets, 0, 4);
    }
    int32_t *index = (int32_t *)PyBytes_AS_STRING(bufs[1]);
    unsigned char *valid = (unsigned char *)PyBytes_AS_STRING(bufs[2]);
    int8_t *kind = (int8_t *)PyBytes_AS_STRING(bufs[3]);
    int32_t *partition = (int32_t *)PyBytes_AS_STRING(bufs[4]);
    int64_t *offset = (int64_t *)PyBytes_AS_STRING(bufs[5]);
    int32_t *attempt = (int32_t *)PyBytes_AS_STRING(bufs[6]);
    int32_t *origin_partition = (int32_t *)PyBytes_AS_STRING(bufs[7]);
    int64_t *origin_offset = (int64_t *)PyBytes_AS_STRING(bufs[8]);
    int64_t *timeout = (int64_t *)PyBytes_AS_STRING(bufs[9]);
    int64_t *delay = (int64_t *)PyBytes_AS_STRING(bufs[10]);
    uint8_t *policy = (uint8_t *)PyBytes_AS_STRING(bufs[11]);
    uint8_t *deferred = (uint8_t *)PyBytes_AS_STRING(bufs[12]);
    memset(valid, 0, (size_t)(vbytes ? vbytes : 1));

#define PUT_TEXT(c, ptr, len)                                                   \
    do {                                                                        \
        memcpy(str[c].data + str[c].used, (ptr), (size_t)(len));                \
        str[c].used += (len);                                                   \
        int32_t end_ = (int32_t)str[c].used;                                    \
        memcpy(str[c].offsets + 4 * (r + 1), &end_, 4);                         \
    } while (0)

    Py_ssize_t r = 0;
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = items[i];
        const char *p[N_STR_COLS];
        Py_ssize_t len[N_STR_COLS];
        if (m == Py_None) {
            index[r] = (int32_t)i;
            kind[r] = 0;
            partition[r] = attempt[r] = origin_partition[r] = 0;
            offset[r] = origin_offset[r] = timeout[r] = delay[r] = 0;
            policy[r] = deferred[r] = 0;
            for (int c = 0; c < N_STR_COLS; c++) PUT_TEXT(c, "", 0);
            r++;
            continue;
        }
        if (Py_TYPE(m) == range_type) {
            int8_t k = (int8_t)as_int64(PyTuple_GET_ITEM(m, 0), &bad);
            int32_t part = (int32_t)as_int64(PyTuple_GET_ITEM(m, 3), &bad);
            int64_t first = as_int64(PyTuple_GET_ITEM(m, 4), &bad);
            int64_t last = as_int64(PyTuple_GET_ITEM(m, 5), &bad);
            int64_t lease = as_int64(PyTuple_GET_ITEM(m, 7), &bad);
            if (bad) goto done;
            utf8_of(PyTuple_GET_ITEM(m, 1), &p[0], &len[0]);
            utf8_of(PyTuple_GET_ITEM(m, 2), &p[1], &len[1]);
            utf8_of(PyTuple_GET_ITEM(m, 8), &p[3], &len[3]);
            uint64_t width = (uint64_t)(last - first) + 1;
            unsigned char *covered = range_covered(m, width);
            if (covered == NULL) goto done;
            for (uint64_t b = 0; b < width; b++) {
                if (!(covered[b >> 3] & (1u << (b & 7)))) continue;
                index[r] = (int32_t)i;
                valid[r >> 3] |= (unsigned char)(1u << (r & 7));
                kind[r] = k;
                partition[r] = origin_partition[r] = part;
                offset[r] = origin_offset[r] = first + (int64_t)b;
                attempt[r] = 1;
                timeout[r] = lease;
                delay[r] = 0;
                policy[r] = deferred[r] = 0;
                PUT_TEXT(0, p[0], len[0]);
                PUT_TEXT(1, p[1], len[1]);
                PUT_TEXT(2, p[1], len[1]);
                PUT_TEXT(3, p[3], len[3]);
                PUT_TEXT(4, "", 0);
                r++;
            }
            PyMem_Free(covered);
            continue;
        }
        static const int fields[N_STR_COLS] = {1, 2, 6, 12, 13};
        index[r] = (int32_t)i;
        valid[r >> 3] |= (unsigned char)(1u << (r & 7));
        kind[r] = (int8_t)as_int64(PyTuple_GET_ITEM(m, 0), &bad);
        partition[r] = (int32_t)as_int64(PyTuple_GET_ITEM(m, 3), &bad);
        offset[r] = as_int64(PyTuple_GET_ITEM(m, 4), &bad);
        attempt[r] = (int32_t)as_int64(PyTuple_GET_ITEM(m, 5), &bad);
        origin_partition[r] = (int32_t)as_int64(PyTuple_GET_ITEM(m, 7), &bad);
        origin_offset[r] = as_int64(PyTuple_GET_ITEM(m, 8), &bad);
        timeout[r] = as_int64(PyTuple_GET_ITEM(m, 9), &bad);
        delay[r] = as_int64(PyTuple_GET_ITEM(m, 10), &bad);
        policy[r] = PyTuple_GET_ITEM(m, 11) == Py_True;
        deferred[r] = PyTuple_GET_ITEM(m, 14) == Py_True;
        if (bad) goto done;
        for (int c = 0; c < N_STR_COLS; c++) {
            utf8_of(PyTuple_GET_ITEM(m, fields[c]), &p[c], &len[c]);
            PUT_TEXT(c, p[c], len[c]);
        }
        r++;
    }
#undef PUT_TEXT
    if (r != rows) {
        PyErr_SetString(PyExc_RuntimeError, "marker_columns: row count changed while filling");
        goto done;
    }
    result = PyTuple_New(14 + 2 * N_STR_COLS - 1);
    if (result == NULL) goto done;
    PyTuple_SET_ITEM(result, 0, PyLong_FromSsize_t(rows));
    for (int b = 1; b < 13 + 2 * N_STR_COLS; b++) {
        PyTuple_SET_ITEM(result, b, bufs[b]); /* steals */
        bufs[b] = NULL;
    }
    if (PyTuple_GET_ITEM(result, 0) == NULL) Py_CLEAR(result);

done:
    for (int b = 0; b < 13 + 2 * N_STR_COLS; b++) Py_XDECREF(bufs[b]);
    Py_DECREF(seq);
    return result;
}

static PyObject *configure(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *cls, *kinds_arg, *err, *rcls = NULL, *rkinds = NULL;
    if (!PyArg_ParseTuple(args, "O!O!O|O!O!", &PyType_Type, &cls, &PyTuple_Type, &kinds_arg, &err,
                          &PyType_Type, &rcls, &PyTuple_Type, &rkinds)) {
        return NULL;
    }
    if (rcls != NULL) {
        if (rkinds == NULL || !PyType_IsSubtype((PyTypeObject *)rcls, &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "configure(..., range tuple subclass, range kinds)");
            return NULL;
        }
        Py_INCREF(rcls);
        Py_INCREF(rkinds);
        Py_XSETREF(range_type, (PyTypeObject *)rcls);
        Py_XSETREF(range_kinds, rkinds);
    }
    if (!PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type) || PyTuple_GET_SIZE(kinds_arg) != 6) {
        PyErr_SetString(PyExc_TypeError, "configure(tuple subclass, 6-tuple of kinds, error class)");
        return NULL;
    }
    Py_INCREF(cls);
    Py_INCREF(kinds_arg);
    Py_INCREF(err);
    Py_XSETREF(marker_type, (PyTypeObject *)cls);
    Py_XSETREF(kinds, kinds_arg);
    Py_XSETREF(error_cls, err);
    Py_RETURN_NONE;
}

static PyObject *untrack_list(PyObject *module, PyObject *arg) {
    if (!PyList_CheckExact(arg)) {
        /* Not what aiokafka returns today: leave it as it is (tracked: correct, slower). */
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        if (PyObject_IS_GC(item) && PyObject_GC_IsTracked(item)) {
            PyObject_GC_UnTrack(item);
        }
    }
    /* The list too: a collection that walks a list touches the header of every item in it,
     * tracked or not (tens of thousands of cache misses for the batches held ahead). */
    if (PyObject_GC_IsTracked(arg)) {
        PyObject_GC_UnTrack(arg);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_O, "Decode one marker value (see tracker.protocol.decode_marker)."},
    {"decode_many", decode_many, METH_O,
     "decode_many(values) -> (markers, [(index, message), ...]) (see tracker.protocol.decode_batch)."},
    {"sort_records", sort_records, METH_VARARGS,
     "sort_records(records, markers_partition, now_ms, pending_cls) -> (accepted, errors, wheres, "
     "samples, where_of) (see tracker.engine.record_decoding)."},
    {"marker_columns", marker_columns, METH_O,
     "marker_columns(markers) -> column buffers, one row per message (see pipeline.marker_batches)."},
    {"untrack_list", untrack_list, METH_O,
     "untrack_list(items): take a list and its items out of the cyclic GC (see tracker.client.gc_untrack)."},
    {"configure", configure, METH_VARARGS,
     "configure(marker_cls, kinds, error_cls, range_cls, range_kinds)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "tracker._speedups", "C decoder for kmq markers; GC untracking of fetched records.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    empty_str = PyUnicode_FromString("");
    if (empty_str == NULL) return NULL;
    attr_value = PyUnicode_InternFromString("value");
    attr_timestamp = PyUnicode_InternFromString("timestamp");
    attr_offset = PyUnicode_InternFromString("offset");
    if (attr_value == NULL || attr_timestamp == NULL || attr_offset == NULL) return NULL;
    return PyModule_Create(&module_def);
}
