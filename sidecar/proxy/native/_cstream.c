/* The proxies' compiled reader: de-chunking (csrc/dechunk.h), the scan of an incremental
 * stream's delta frames (csrc/deltas.h), log-prob triples read into arrays, correctly rounded
 * (csrc/numbers.h), and JSON's structure walked for the spans of values and one member's
 * values in an array of objects (csrc/jsonwalk.h).
 * Without this module (no C compiler at install, or TIMWATCH_NATIVE=0) the proxies read every
 * frame and answer whole with orjson, and give the same records (tests/unit/test_cstream.py).
 * Each function checks the sizes of the buffers it writes, and releases the GIL while it runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "csrc/dechunk.h"
#include "csrc/deltas.h"
#include "csrc/jsonwalk.h"
#include "csrc/numbers.h"

/* ---------------------------------------------------------------- Python bindings */

static int need(Py_buffer *v, Py_ssize_t bytes, const char *what) {
    if (v->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, v->len, bytes);
        return 0;
    }
    return 1;
}

static PyObject *py_dechunk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf, state;
    if (!PyArg_ParseTuple(args, "y*w*", &buf, &state)) return NULL;
    PyObject *out = NULL;
    if (need(&state, 5 * sizeof(i64), "state")) {
        /* the body is written straight into the bytes object returned: no second copy */
        out = PyBytes_FromStringAndSize(NULL, buf.len);
        if (out != NULL) {
            i64 got;
            uint8_t *to = (uint8_t *)PyBytes_AS_STRING(out);
            Py_BEGIN_ALLOW_THREADS;
            got = dechunk((const uint8_t *)buf.buf, buf.len, to, (i64 *)state.buf);
            Py_END_ALLOW_THREADS;
            if (got < buf.len && _PyBytes_Resize(&out, got) < 0) out = NULL;
        }
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&state);
    return out;
}

static PyObject *py_scan_deltas(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf, rows, ids, vals, table;
    Py_ssize_t small;
    if (!PyArg_ParseTuple(args, "y*nw*w*w*y*", &buf, &small, &rows, &ids, &vals, &table))
        return NULL;
    PyObject *res = NULL;
    i64 n = buf.len, cap = rows.len / (7 * (Py_ssize_t)sizeof(i64));
    Py_ssize_t room = (n / 10 + 1) * 8;
    if (need(&ids, room, "ids") && need(&vals, room, "vals") &&
        need(&table, 2 * (Q_MAX - Q_MIN + 1) * 8, "table")) {
        Walk w;
        i64 counted;
        Py_BEGIN_ALLOW_THREADS;
        const uint8_t *b = (const uint8_t *)buf.buf;
        w = walk(b, n, small, (i64 *)rows.buf, cap, (i64 *)ids.buf, (double *)vals.buf,
                 (const u64 *)table.buf);
        /* every frame read holds its finish key, its two list keys and its "\n\n" */
        counted = marks(b, n, w.start);
        if (counted != 5 * w.frames) counted = exact_marks(b, w.start);
        Py_END_ALLOW_THREADS;
        if (counted != 5 * w.frames) w.start = -1;
        res = Py_BuildValue("LLLO", (long long)w.r, (long long)w.start, (long long)w.count,
                            w.stopped ? Py_True : Py_False);
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&table);
    return res;
}

static PyObject *py_triples(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf, ids, vals, table;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*nw*w*y*", &buf, &pos, &ids, &vals, &table)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t room = ((buf.len - pos) / 10 + 1) * 8;
    if (pos < 0 || pos > buf.len) {
        PyErr_SetString(PyExc_ValueError, "pos outside the buffer");
    } else if (need(&ids, room, "ids") && need(&vals, room, "vals") &&
               need(&table, 2 * (Q_MAX - Q_MIN + 1) * 8, "table")) {
        i64 count, end;
        Py_BEGIN_ALLOW_THREADS;
        count = triples_into((const uint8_t *)buf.buf, buf.len, pos, (i64 *)ids.buf,
                             (double *)vals.buf, 0, (const u64 *)table.buf, &end);
        Py_END_ALLOW_THREADS;
        res = Py_BuildValue("LL", (long long)count, (long long)end);
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&table);
    return res;
}

static PyObject *py_walk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf, rows;
    Py_ssize_t max_depth, max_array_depth;
    if (!PyArg_ParseTuple(args, "y*nnw*", &buf, &max_depth, &max_array_depth, &rows)) return NULL;
    i64 got;
    i64 cap = rows.len / (W_COLS * (Py_ssize_t)sizeof(i64));
    Py_BEGIN_ALLOW_THREADS;
    got = walk_json((const uint8_t *)buf.buf, buf.len, max_depth, max_array_depth,
                    (i64 *)rows.buf, cap);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&buf);
    PyBuffer_Release(&rows);
    return PyLong_FromLongLong((long long)got);
}

static PyObject *py_member_values(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf, key;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*ny*", &buf, &pos, &key)) return NULL;
    PyObject *res = NULL;
    if (pos < 0 || pos > buf.len) {
        PyErr_SetString(PyExc_ValueError, "pos outside the buffer");
    } else {
        PyObject *out = PyBytes_FromStringAndSize(NULL, buf.len - pos + 2);
        if (out != NULL) {
            i64 count, length;
            uint8_t *to = (uint8_t *)PyBytes_AS_STRING(out);
            Py_BEGIN_ALLOW_THREADS;
            count = member_values((const uint8_t *)buf.buf, buf.len, pos,
                                  (const uint8_t *)key.buf, key.len, to, &length);
            Py_END_ALLOW_THREADS;
            if (_PyBytes_Resize(&out, count < 0 ? 0 : length) == 0)
                res = Py_BuildValue("LN", (long long)count, out);
        }
    }
    PyBuffer_Release(&buf);
    PyBuffer_Release(&key);
    return res;
}

static PyMethodDef methods[] = {
    {"dechunk", py_dechunk, METH_VARARGS,
     "dechunk(data, state) -> the body bytes data carries; state: (phase, left, digits, "
     "line, safe) int64"},
    {"scan_deltas", py_scan_deltas, METH_VARARGS,
     "scan_deltas(buf, small, rows, ids, vals, pow5) -> (rows, consumed, values, stopped); "
     "consumed -1: declined"},
    {"triples", py_triples, METH_VARARGS,
     "triples(buf, pos, ids, vals, pow5) -> (count, end): the [[logprob,id,null],...] list at "
     "buf[pos]; count -1: refused"},
    {"walk", py_walk, METH_VARARGS,
     "walk(buf, max_depth, max_array_depth, rows) -> row count; -1: not one JSON object, "
     "-2: rows too short"},
    {"member_values", py_member_values, METH_VARARGS,
     "member_values(buf, pos, key) -> (count, json): each object's scalar value of member key "
     "in the array at buf[pos], as one JSON list; count -1: refused"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cstream", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cstream(void) { return PyModule_Create(&module); }
