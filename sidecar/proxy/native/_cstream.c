/* The stream reader's two hot loops in C: `dechunk` (dechunk.py's `_dechunk`) and
 * `scan_deltas` (deltascan.py's `_walk` and its mark count, with numparse.py's
 * correctly rounded log-prob parse). Each is the same algorithm as its numba twin, answer for
 * answer (test_dechunk.py and test_deltascan.py run on both; test_cstream.py compares them on
 * generated streams). Where the time goes differs: here frame ends and quotes are found with
 * libc's memchr, copies are memcpy, and the mark count sums its flags 32 byte lanes at a time,
 * none of which numba's loops compile to. Built when a C compiler is there (setup.py,
 * optional); the Python modules fall back to numba when it is not. The GIL is released while
 * they run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "csrc/dechunk.h"
#include "csrc/deltas.h"
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

static PyMethodDef methods[] = {
    {"dechunk", py_dechunk, METH_VARARGS,
     "dechunk(data, state) -> the body bytes data carries (dechunk.py's _dechunk)"},
    {"scan_deltas", py_scan_deltas, METH_VARARGS,
     "scan_deltas(buf, small, rows, ids, vals, pow5) -> (rows, consumed, values, stopped); "
     "consumed -1: declined (deltascan.py's _scan_deltas)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cstream", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cstream(void) { return PyModule_Create(&module); }
