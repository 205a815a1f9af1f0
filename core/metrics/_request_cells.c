/* A server's per-request counts, in C: clusterwire.metrics.requests' RequestCells.
 *
 * Every request that crosses a transport is counted by its server's listener shell: its
 * method's latency bucket and sum, its status code when not OK, its bytes in and out.
 * In Python that bookkeeping touches a dict, two lists of int objects, a float and each
 * buffer's attributes; on a short same-host call it ran with cold caches (the client had
 * just run on the same CPU) and cost a measurable part of the call. Here it is one call
 * on a few cache lines. requests.py holds the same rules in Python, used when this module
 * is not built; a test holds the two equal.
 *
 * Not thread-safe by itself: the shell calls it under its own lock (and the GIL).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_BOUNDS 32
#define MAX_CODES 32

typedef struct {
    PyObject *name;                      /* the method, a str */
    uint64_t counts[MAX_BOUNDS + 1];     /* per latency bucket, the last one +Inf */
    uint64_t errors[MAX_CODES];          /* per status code (OK is the counts' rest) */
    double sum;                          /* seconds */
} MethodCell;

typedef struct {
    PyObject_HEAD
    double bounds[MAX_BOUNDS];
    Py_ssize_t nbounds;
    int ncodes;
    MethodCell *cells;
    Py_ssize_t ncells, capacity;
    uint64_t received, sent;
} RequestCells;

static PyObject *str_header, *str_buffers, *str_nbytes;
static PyObject *perf_counter;  /* time.perf_counter: the clock of started */

static int
cells_init(RequestCells *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"bounds", "codes", NULL};
    PyObject *bounds;
    int ncodes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oi", names, &bounds, &ncodes))
        return -1;
    PyObject *fast = PySequence_Fast(bounds, "bounds must be a sequence of floats");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_BOUNDS || ncodes < 1 || ncodes > MAX_CODES) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "at most %d bounds and 1 to %d codes", MAX_BOUNDS,
                     MAX_CODES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        self->bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (self->bounds[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    self->nbounds = n;
    self->ncodes = ncodes;
    return 0;
}

static void
cells_dealloc(RequestCells *self)
{
    for (Py_ssize_t i = 0; i < self->ncells; i++)
        Py_DECREF(self->cells[i].name);
    PyMem_Free(self->cells);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The cell of ``method``, made on first use; NULL with an exception set. */
static MethodCell *
cell_of(RequestCells *self, PyObject *method)
{
    for (Py_ssize_t i = 0; i < self->ncells; i++)  /* a handful of methods: the same str */
        if (self->cells[i].name == method)
            return &self->cells[i];
    if (!PyUnicode_Check(method)) {
        PyErr_Format(PyExc_TypeError, "method must be a str, not %.100s",
                     Py_TYPE(method)->tp_name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->ncells; i++)  /* the same name, another str */
        if (PyUnicode_Compare(self->cells[i].name, method) == 0)
            return &self->cells[i];
    if (self->ncells == self->capacity) {
        Py_ssize_t capacity = self->capacity ? 2 * self->capacity : 8;
        MethodCell *grown = PyMem_Realloc(self->cells, capacity * sizeof(MethodCell));
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->cells = grown;
        self->capacity = capacity;
    }
    MethodCell *cell = &self->cells[self->ncells++];
    memset(cell, 0, sizeof(*cell));
    Py_INCREF(method);
    cell->name = method;
    return cell;
}

/* The bytes of one buffer: a buffer-protocol object, or one that tells its nbytes (a
 * forwarded response relayed as it arrives). -1 with an exception set. */
static Py_ssize_t
buffer_bytes(PyObject *buffer)
{
    if (PyBytes_CheckExact(buffer))
        return PyBytes_GET_SIZE(buffer);
    if (PyMemoryView_Check(buffer))
        return PyMemoryView_GET_BUFFER(buffer)->len;
    PyObject *nbytes = PyObject_GetAttr(buffer, str_nbytes);
    if (nbytes != NULL) {
        Py_ssize_t n = PyLong_AsSsize_t(nbytes);
        Py_DECREF(nbytes);
        if (n < 0 && !PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "a buffer of %zd bytes", n);
        return n;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
        return -1;
    PyErr_Clear();
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_FULL_RO) < 0)  /* as memoryview() asks */
        return -1;
    Py_ssize_t n = view.len;
    PyBuffer_Release(&view);
    return n;
}

/* A frame's bytes: its header and its buffers. -1 with an exception set. */
static Py_ssize_t
frame_bytes(PyObject *frame)
{
    PyObject *header = PyObject_GetAttr(frame, str_header);
    if (header == NULL)
        return -1;
    Py_ssize_t total = buffer_bytes(header);
    Py_DECREF(header);
    if (total < 0)
        return -1;
    PyObject *buffers = PyObject_GetAttr(frame, str_buffers);
    if (buffers == NULL)
        return -1;
    PyObject *fast = PySequence_Fast(buffers, "a frame's buffers must be a sequence");
    Py_DECREF(buffers);
    if (fast == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t n = buffer_bytes(PySequence_Fast_GET_ITEM(fast, i));
        if (n < 0) {
            Py_DECREF(fast);
            return -1;
        }
        total += n;
    }
    Py_DECREF(fast);
    return total;
}

PyDoc_STRVAR(record_doc,
"record(method, code, started, request, response)\n\n"
"Count a request that came through the transport: its latency (from started, the\n"
"time.perf_counter() of its arrival, to now), its code when not OK, the bytes of its\n"
"request and response frames.");

static PyObject *
cells_record(RequestCells *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "record() takes 5 arguments");
        return NULL;
    }
    long code = PyLong_AsLong(args[1]);
    double started = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *now = PyObject_CallNoArgs(perf_counter);
    if (now == NULL)
        return NULL;
    double seconds = PyFloat_AsDouble(now) - started;
    Py_DECREF(now);
    if (code < 0 || code >= self->ncodes) {
        PyErr_Format(PyExc_ValueError, "status code %ld out of range", code);
        return NULL;
    }
    Py_ssize_t received = frame_bytes(args[3]);
    if (received < 0)
        return NULL;
    Py_ssize_t sent = frame_bytes(args[4]);
    if (sent < 0)
        return NULL;
    MethodCell *cell = cell_of(self, args[0]);
    if (cell == NULL)
        return NULL;
    Py_ssize_t low = 0, high = self->nbounds;  /* bisect_left: the first bound >= seconds */
    while (low < high) {
        Py_ssize_t middle = (low + high) / 2;
        if (self->bounds[middle] < seconds)
            low = middle + 1;
        else
            high = middle;
    }
    cell->counts[low]++;
    cell->sum += seconds;
    if (code)
        cell->errors[code]++;
    self->received += (uint64_t)received;
    self->sent += (uint64_t)sent;
    Py_RETURN_NONE;
}

static PyObject *
u64_list(const uint64_t *values, Py_ssize_t count)
{
    PyObject *list = PyList_New(count);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(values[i]);
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

PyDoc_STRVAR(snapshot_doc,
"snapshot() -> (latency, errors, received, sent)\n\n"
"latency: method -> [count per bucket (the last: +Inf)..., sum of seconds];\n"
"errors: method -> [count per status code]; bytes received and sent.");

static PyObject *
cells_snapshot(RequestCells *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *latency = PyDict_New(), *errors = PyDict_New();
    if (latency == NULL || errors == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < self->ncells; i++) {
        MethodCell *cell = &self->cells[i];
        PyObject *counts = u64_list(cell->counts, self->nbounds + 1);
        if (counts == NULL)
            goto fail;
        PyObject *sum = PyFloat_FromDouble(cell->sum);
        if (sum == NULL || PyList_Append(counts, sum) < 0) {
            Py_XDECREF(sum);
            Py_DECREF(counts);
            goto fail;
        }
        Py_DECREF(sum);
        int failed = PyDict_SetItem(latency, cell->name, counts) < 0;
        Py_DECREF(counts);
        if (failed)
            goto fail;
        PyObject *by_code = u64_list(cell->errors, self->ncodes);
        if (by_code == NULL)
            goto fail;
        failed = PyDict_SetItem(errors, cell->name, by_code) < 0;
        Py_DECREF(by_code);
        if (failed)
            goto fail;
    }
    return Py_BuildValue("(NNKK)", latency, errors, (unsigned long long)self->received,
                         (unsigned long long)self->sent);
fail:
    Py_XDECREF(latency);
    Py_XDECREF(errors);
    return NULL;
}

static PyMethodDef cells_methods[] = {
    {"record", (PyCFunction)(void (*)(void))cells_record, METH_FASTCALL, record_doc},
    {"snapshot", (PyCFunction)cells_snapshot, METH_NOARGS, snapshot_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RequestCellsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "clusterwire.metrics._request_cells.RequestCells",
    .tp_doc = PyDoc_STR("RequestCells(bounds, codes): one server's request counts."),
    .tp_basicsize = sizeof(RequestCells),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cells_init,
    .tp_dealloc = (destructor)cells_dealloc,
    .tp_methods = cells_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_request_cells", "A server's per-request counts, in C.", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__request_cells(void)
{
    str_header = PyUnicode_InternFromString("header");
    str_buffers = PyUnicode_InternFromString("buffers");
    str_nbytes = PyUnicode_InternFromString("nbytes");
    if (str_header == NULL || str_buffers == NULL || str_nbytes == NULL)
        return NULL;
    PyObject *time = PyImport_ImportModule("time");
    if (time == NULL)
        return NULL;
    perf_counter = PyObject_GetAttrString(time, "perf_counter");
    Py_DECREF(time);
    if (perf_counter == NULL)
        return NULL;
    if (PyType_Ready(&RequestCellsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RequestCellsType);
    if (PyModule_AddObject(m, "RequestCells", (PyObject *)&RequestCellsType) < 0) {
        Py_DECREF(&RequestCellsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
