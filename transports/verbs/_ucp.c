/* The per-call path of grpc+verbs, in C.
 *
 * A call's request and reply are one UCX tagged message each. Doing the
 * send, progress, probe, receive, arm and poll of that round trip from Python
 * cost several times what UCX itself does (about 40 Python-level steps per
 * side), so this module does them in few C calls and releases the GIL while it
 * sleeps: a client's round trip (exchange), a step of the worker that takes
 * what arrived and finishes what completed (step, take, send, test), and the
 * control messages' codec (encode, decode: wire.py's, byte for byte). The
 * engine's logic (who drives the worker, serving threads, expectations) stays
 * in Python (engine.py).
 *
 * The UCP functions are taken at run time from the libucp that ucxx has
 * already loaded, so building this module needs no UCX headers: the few
 * declarations below follow UCX 1.x's stable ABI (ucp/api/ucp.h). Every UCX
 * call is made holding the engine's UCX lock (a Python lock passed in), as
 * the rest of the engine does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int8_t ucs_status_t; /* a packed enum in UCX */
typedef uint64_t ucp_tag_t;
typedef struct {
    ucp_tag_t sender_tag;
    size_t length;
} ucp_tag_recv_info_t;
typedef struct {
    uint32_t op_attr_mask; /* 0: no callback, default datatype, UCX allocates the request */
    uint32_t flags;
    void *fields[8];       /* read only when op_attr_mask names them */
} ucp_request_param_t;

#define UCS_OK 0
#define UCS_INPROGRESS 1
#define UCS_ERR_MESSAGE_TRUNCATED (-9)
#define UCS_ERR_BUSY (-15)
#define UCS_ERR_LAST (-100)
#define PTR_IS_ERR(p) ((uintptr_t)(p) >= (uintptr_t)(intptr_t)UCS_ERR_LAST)
#define PTR_STATUS(p) ((ucs_status_t)(intptr_t)(p))

static struct {
    unsigned (*worker_progress)(void *worker);
    ucs_status_t (*worker_arm)(void *worker);
    ucs_status_t (*worker_get_efd)(void *worker, int *fd);
    void *(*tag_send_nbx)(void *ep, const void *buffer, size_t count, ucp_tag_t tag,
                          const ucp_request_param_t *param);
    void *(*tag_probe_nb)(void *worker, ucp_tag_t tag, ucp_tag_t mask, int remove,
                          ucp_tag_recv_info_t *info);
    void *(*tag_msg_recv_nbx)(void *worker, void *buffer, size_t count, void *message,
                              const ucp_request_param_t *param);
    ucs_status_t (*request_check_status)(void *request);
    void (*request_cancel)(void *worker, void *request);
    void (*request_free)(void *request);
    const char *(*status_string)(ucs_status_t status);
} ucp;

static PyObject *UcxError;
/* Where a message is received unstored: a 1-byte receive of a longer message ends
 * truncated. UCX writes it only while progressed, under the UCX lock. */
static char scratch[1];
static PyObject *acquire_name, *release_name, *closed_name, *handle_name, *stopping_name;

/* What exchange() returns first. */
enum { REPLIED = 1, TIMED_OUT, WATCHED, WOKEN, TOO_LONG, STOPPED };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int call_method(PyObject *object, PyObject *name) {
    PyObject *result = PyObject_CallMethodNoArgs(object, name);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* 1 if ``object.name`` is true, 0 if not, -1 on error. */
static int flag(PyObject *object, PyObject *name) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL)
        return -1;
    int set = PyObject_IsTrue(value);
    Py_DECREF(value);
    return set;
}

/* The ucp_ep_h of ``endpoint`` (its ``handle``), or NULL with an exception set. */
static void *endpoint_handle(PyObject *endpoint) {
    PyObject *handle = PyObject_GetAttr(endpoint, handle_name);
    void *ep = handle == NULL ? NULL : PyLong_AsVoidPtr(handle);
    Py_XDECREF(handle);
    if (ep == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "the endpoint has no UCP handle");
    return ep;
}

static PyObject *ucx_error(const char *what, ucs_status_t status) {
    PyErr_Format(UcxError, "%s: %s", what, ucp.status_string(status));
    return NULL;
}

static void drain(int fd) {
    char sink[64];
    while (read(fd, sink, sizeof sink) > 0) {
    }
}

/* NULL while ``request`` is unfinished, else "" (success) or UCX's error; frees it then. */
static const char *finish(void *request) {
    ucs_status_t status = ucp.request_check_status(request);
    if (status == UCS_INPROGRESS)
        return NULL;
    ucp.request_free(request);
    return status == UCS_OK ? "" : ucp.status_string(status);
}

/* Give up an unfinished request. UCX may still use its buffer, the bytes of
 * ``owner``, until the request finishes: if cancelling does not finish it at
 * once, ``owner`` is kept alive for good (a failure path, and a small leak
 * rather than UCX writing into or reading from freed memory). */
static void abandon(void *worker, void *request, PyObject *owner) {
    ucp.request_cancel(worker, request);
    for (int i = 0; i < 100 && ucp.request_check_status(request) == UCS_INPROGRESS; i++)
        ucp.worker_progress(worker);
    if (ucp.request_check_status(request) == UCS_INPROGRESS)
        Py_XINCREF(owner);
    ucp.request_free(request);
}

static PyObject *bind(PyObject *module, PyObject *unused) {
    void *ucp_lib = dlopen("libucp.so.0", RTLD_NOW | RTLD_NOLOAD);
    void *ucs_lib = dlopen("libucs.so.0", RTLD_NOW | RTLD_NOLOAD);
    if (ucp_lib == NULL || ucs_lib == NULL)
        return PyErr_Format(PyExc_ImportError, "libucp/libucs are not loaded (import ucxx first)");
#define RESOLVE(lib, field, symbol)                                                        \
    if ((*(void **)&ucp.field = dlsym(lib, symbol)) == NULL)                               \
        return PyErr_Format(PyExc_ImportError, "UCX has no %s", symbol);
    RESOLVE(ucp_lib, worker_progress, "ucp_worker_progress")
    RESOLVE(ucp_lib, worker_arm, "ucp_worker_arm")
    RESOLVE(ucp_lib, worker_get_efd, "ucp_worker_get_efd")
    RESOLVE(ucp_lib, tag_send_nbx, "ucp_tag_send_nbx")
    RESOLVE(ucp_lib, tag_probe_nb, "ucp_tag_probe_nb")
    RESOLVE(ucp_lib, tag_msg_recv_nbx, "ucp_tag_msg_recv_nbx")
    RESOLVE(ucp_lib, request_check_status, "ucp_request_check_status")
    RESOLVE(ucp_lib, request_cancel, "ucp_request_cancel")
    RESOLVE(ucp_lib, request_free, "ucp_request_free")
    RESOLVE(ucs_lib, status_string, "ucs_status_string")
#undef RESOLVE
    Py_RETURN_NONE;
}

/* Begin receiving the probed message ``found`` of ``length`` bytes into a new buffer
 * (``*buffer``): bytes, or the writable object ``allocate(length)`` returns unless
 * ``allocate`` is None. One over ``limit`` bytes, or one whose buffer could not be made, is
 * consumed unstored (a 1-byte receive into scratch ends truncated): ``*buffer`` is then NULL.
 * Returns 0 when UCX finished the receive at once, 1 when ``*request`` is its unfinished
 * request, -1 when UCX refused it (``*failure`` says why; ``*buffer`` is NULL then). */
static int begin_receive(void *worker, void *found, size_t length, Py_ssize_t limit,
                         PyObject *allocate, PyObject **buffer, void **request,
                         const char **failure) {
    void *into = scratch;
    size_t size = 1;
    *buffer = NULL;
    *request = NULL;
    if (length <= (size_t)limit && allocate == Py_None) {
        *buffer = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
        if (*buffer != NULL)
            into = PyBytes_AS_STRING(*buffer), size = length;
    } else if (length <= (size_t)limit) {
        Py_buffer view;
        *buffer = PyObject_CallFunction(allocate, "n", (Py_ssize_t)length);
        if (*buffer != NULL && PyObject_GetBuffer(*buffer, &view, PyBUF_WRITABLE) < 0)
            Py_CLEAR(*buffer);
        if (*buffer != NULL) {
            into = view.buf, size = length;
            PyBuffer_Release(&view); /* ``*buffer`` keeps the memory */
        }
    }
    if (*buffer == NULL)
        PyErr_Clear(); /* consume the message all the same; the caller reports it */
    ucp_request_param_t param;
    memset(&param, 0, sizeof param);
    void *received = ucp.tag_msg_recv_nbx(worker, into, size, found, &param);
    if (!PTR_IS_ERR(received)) {
        *request = received;
        return received != NULL;
    }
    if (into == scratch && PTR_STATUS(received) == UCS_ERR_MESSAGE_TRUNCATED)
        return 0;
    Py_CLEAR(*buffer);
    *failure = ucp.status_string(PTR_STATUS(received));
    return -1;
}

/* exchange(worker, endpoint, message, tag, reply_tag, watch_tag, watch_mask, limit,
 *          poll_fd, wake_fd, timeout, lock, engine) -> (outcome, value, pending_send)
 *
 * Sends ``message`` (unless None) tagged ``tag`` on ``endpoint`` (an object
 * with the UCP endpoint's ``handle`` and a ``closed`` flag), then drives
 * ``worker`` until the message tagged exactly ``reply_tag`` has been received
 * (REPLIED, value: its bytes), one over ``limit`` bytes was consumed unstored
 * (TOO_LONG, value: its length), a message matching ``watch_tag``/``watch_mask``
 * waits (WATCHED; ``watch_mask`` 0 watches nothing), ``wake_fd`` was written
 * (WOKEN), ``timeout`` seconds passed (TIMED_OUT) or ``engine._stopping`` was
 * set (STOPPED; checked whenever ``lock`` is taken). Between events it sleeps
 * in poll on ``poll_fd`` (the worker's) and ``wake_fd``, without the GIL and
 * without ``lock``. ``pending_send`` is the handle of a send UCX has not
 * finished (0 if none): the caller keeps ``message`` alive and checks it with
 * ``test`` until it has. A receive that has begun is finished before
 * returning (the timeout then cancels it: UcxError).
 */
static PyObject *exchange(PyObject *module, PyObject *args) {
    unsigned long long worker_h, tag, reply_tag, watch_tag, watch_mask;
    PyObject *endpoint, *message, *lock, *engine;
    Py_ssize_t limit;
    int poll_fd, wake_fd;
    double timeout;
    if (!PyArg_ParseTuple(args, "KOOKKKKniidOO", &worker_h, &endpoint, &message, &tag,
                          &reply_tag, &watch_tag, &watch_mask, &limit, &poll_fd, &wake_fd,
                          &timeout, &lock, &engine))
        return NULL;
    void *worker = (void *)(uintptr_t)worker_h;
    double deadline = now() + timeout;
    ucp_request_param_t param;
    memset(&param, 0, sizeof param);
    void *send_request = NULL, *recv_request = NULL;
    PyObject *reply = NULL;
    size_t too_long = 0;
    int outcome = 0, out_of_memory = 0;
    const char *failed = NULL;
    ucs_status_t status = UCS_OK;

    if (call_method(lock, acquire_name) < 0)
        return NULL;
    if (message != Py_None) {
        /* Checked under the lock: UCX frees a closed endpoint. */
        int closed = flag(endpoint, closed_name);
        if (closed != 0) {
            if (closed > 0)
                PyErr_SetString(UcxError, "the UCX endpoint is closed");
            goto fail_locked;
        }
        void *ep = endpoint_handle(endpoint);
        Py_buffer view;
        if (ep == NULL || PyObject_GetBuffer(message, &view, PyBUF_SIMPLE) < 0)
            goto fail_locked;
        void *sent = ucp.tag_send_nbx(ep, view.buf, view.len, tag, &param);
        PyBuffer_Release(&view);
        if (PTR_IS_ERR(sent)) {
            failed = "UCX send failed", status = PTR_STATUS(sent);
            goto fail_locked;
        }
        send_request = sent;
    }
    for (;;) {
        int stopping = flag(engine, stopping_name);
        if (stopping != 0) {
            if (stopping < 0)
                goto fail_locked;
            outcome = STOPPED; /* UCX must not be driven any more: leave requests as they are */
            send_request = recv_request = NULL;
            break;
        }
        ucp.worker_progress(worker);
        if (recv_request == NULL && reply == NULL && !too_long) {
            ucp_tag_recv_info_t info;
            void *found = ucp.tag_probe_nb(worker, reply_tag, ~(ucp_tag_t)0, 1, &info);
            if (found != NULL) {
                const char *refused;
                int begun = begin_receive(worker, found, info.length, limit, Py_None, &reply,
                                          &recv_request, &refused);
                if (begun < 0) {
                    PyErr_Format(UcxError, "UCX receive failed: %s", refused);
                    goto fail_locked;
                }
                if (reply == NULL) /* consumed unstored */
                    too_long = info.length, out_of_memory = info.length <= (size_t)limit;
                if (begun > 0)
                    continue; /* it may need progress that no event announces */
            }
        }
        if (recv_request != NULL) {
            status = ucp.request_check_status(recv_request);
            if (status != UCS_INPROGRESS) {
                ucp.request_free(recv_request);
                recv_request = NULL;
                if (status != UCS_OK && !(too_long && status == UCS_ERR_MESSAGE_TRUNCATED)) {
                    failed = "UCX receive failed";
                    goto fail_locked;
                }
            }
        }
        if ((reply != NULL || too_long) && recv_request == NULL) {
            outcome = too_long ? TOO_LONG : REPLIED;
            break;
        }
        if (recv_request == NULL && watch_mask != 0) {
            ucp_tag_recv_info_t info;
            if (ucp.tag_probe_nb(worker, watch_tag, watch_mask, 0, &info) != NULL) {
                outcome = WATCHED;
                break;
            }
        }
        status = ucp.worker_arm(worker);
        if (status == UCS_ERR_BUSY)
            continue;
        if (status != UCS_OK) {
            failed = "UCX could not arm the worker";
            goto fail_locked;
        }
        double remaining = deadline - now();
        if (remaining <= 0) {
            if (recv_request == NULL) {
                outcome = TIMED_OUT;
                break;
            }
            PyErr_SetString(UcxError, "the reply's transfer did not finish in time");
            goto fail_locked;
        }
        if (call_method(lock, release_name) < 0)
            goto fail_unlocked;
        struct pollfd fds[2] = {{poll_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
        int ready;
        Py_BEGIN_ALLOW_THREADS
        ready = poll(fds, 2, (int)(remaining * 1000) + 1);
        Py_END_ALLOW_THREADS
        if (ready < 0 && errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail_unlocked;
        }
        if (call_method(lock, acquire_name) < 0)
            goto fail_unlocked;
        if (fds[1].revents & POLLIN) {
            drain(wake_fd);
            if (recv_request == NULL) {
                outcome = WOKEN;
                break;
            }
        }
    }
    if (out_of_memory) { /* the reply was consumed unstored */
        PyErr_NoMemory();
        goto fail_locked;
    }
    if (send_request != NULL &&
        (status = ucp.request_check_status(send_request)) != UCS_INPROGRESS) {
        ucp.request_free(send_request);
        send_request = NULL;
        if (status != UCS_OK) {
            failed = "UCX send failed";
            goto fail_locked;
        }
    }
    if (call_method(lock, release_name) < 0)
        goto fail_unlocked;
    if (outcome == TOO_LONG)
        return Py_BuildValue("(iKK)", outcome, (unsigned long long)too_long,
                             (unsigned long long)(uintptr_t)send_request);
    return Py_BuildValue("(iNK)", outcome, reply != NULL ? reply : Py_NewRef(Py_None),
                         (unsigned long long)(uintptr_t)send_request);

fail_locked:
    if (recv_request != NULL)
        abandon(worker, recv_request, reply);
    if (send_request != NULL)
        abandon(worker, send_request, message);
    {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        call_method(lock, release_name);
        if (type != NULL)
            PyErr_Restore(type, value, traceback);
        else
            PyErr_Clear();
    }
    Py_XDECREF(reply);
    return failed != NULL ? ucx_error(failed, status) : NULL;
fail_unlocked:
    if (recv_request != NULL || send_request != NULL) {
        /* Cancelling needs the UCX lock again; an error here leaves nothing else to do. */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (call_method(lock, acquire_name) == 0) {
            if (recv_request != NULL)
                abandon(worker, recv_request, reply);
            if (send_request != NULL)
                abandon(worker, send_request, message);
            call_method(lock, release_name);
        }
        PyErr_Restore(type, value, traceback);
    }
    Py_XDECREF(reply);
    return NULL;
}

/* The control message: the envelope of clusterwire.envelope with wire.py's fields (the same
 * bytes and errors; tests/envelope_vectors.json holds what both must produce):
 * "CWV1" | status u32 | key 8 bytes | header_len u32 | count u32 | kind u8 * count |
 * length u64 * count | header | inline bytes, all little-endian and unpadded. The limits are
 * read from clusterwire.envelope when the module is imported. */
#define PREFIX_BYTES 24
#define ENTRY_BYTES 9
#define KEY_BYTES 8
enum { INLINE = 0, BULK = 1 };
static PyObject *InvalidArgumentError, *ResourceExhaustedError;
static unsigned long long max_buffers, max_header_bytes;

static void put_u32(char *at, uint32_t value) {
    for (int i = 0; i < 4; i++)
        at[i] = (char)(value >> (8 * i));
}

static void put_u64(char *at, uint64_t value) {
    for (int i = 0; i < 8; i++)
        at[i] = (char)(value >> (8 * i));
}

static uint64_t get_u64(const unsigned char *at) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--)
        value = value << 8 | at[i];
    return value;
}

static uint32_t get_u32(const unsigned char *at) {
    return (uint32_t)at[0] | (uint32_t)at[1] << 8 | (uint32_t)at[2] << 16 | (uint32_t)at[3] << 24;
}

/* envelope.check_declared: 0, or -1 with ResourceExhaustedError set. */
static int check_declared(unsigned long long count, unsigned long long header_len) {
    if (count > max_buffers) {
        PyErr_Format(ResourceExhaustedError,
                     "Frame declares %llu buffers; the limit is %llu buffers per frame.", count,
                     max_buffers);
        return -1;
    }
    if (header_len > max_header_bytes) {
        PyErr_Format(ResourceExhaustedError,
                     "Frame declares a %llu-byte header; the limit is %llu header bytes.",
                     header_len, max_header_bytes);
        return -1;
    }
    return 0;
}

/* encode(header, buffers, threshold, budget, key, status) -> (message, bulk)
 *
 * wire.encode in C: the buffers under ``threshold`` bytes ride inline until
 * ``budget`` bytes are used (envelope.inline_kinds's rule); ``bulk`` lists
 * the indices of the others, which travel as their own messages.
 */
static PyObject *encode(PyObject *module, PyObject *args) {
    Py_buffer header, key;
    PyObject *buffers;
    Py_ssize_t threshold, budget;
    unsigned int status;
    if (!PyArg_ParseTuple(args, "y*Onny*I", &header, &buffers, &threshold, &budget, &key,
                          &status))
        return NULL;
    PyObject *result = NULL, *message = NULL, *bulk = NULL;
    PyObject *sequence = PySequence_Fast(buffers, "buffers must be a sequence");
    Py_ssize_t count = sequence == NULL ? 0 : PySequence_Fast_GET_SIZE(sequence);
    Py_buffer *views = PyMem_Calloc(count > 0 ? count : 1, sizeof(Py_buffer));
    char *kinds = PyMem_Malloc(count > 0 ? count : 1);
    Py_ssize_t got = 0;
    if (sequence == NULL || views == NULL || kinds == NULL) {
        if (sequence != NULL)
            PyErr_NoMemory();
        goto done;
    }
    if (key.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "the key must be %d bytes, not %zd", KEY_BYTES, key.len);
        goto done;
    }
    Py_ssize_t used = 0, size = PREFIX_BYTES + ENTRY_BYTES * count + header.len;
    for (; got < count; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, got), &views[got],
                               PyBUF_SIMPLE) < 0)
            goto done;
        Py_ssize_t nbytes = views[got].len;
        int small = nbytes < threshold && used + nbytes <= budget;
        kinds[got] = small ? INLINE : BULK;
        if (small)
            used += nbytes, size += nbytes;
    }
    if (check_declared((unsigned long long)count, (unsigned long long)header.len) < 0)
        goto done;
    if ((message = PyBytes_FromStringAndSize(NULL, size)) == NULL ||
        (bulk = PyList_New(0)) == NULL)
        goto done;
    char *at = PyBytes_AS_STRING(message);
    memcpy(at, "CWV1", 4);
    put_u32(at + 4, status);
    memcpy(at + 8, key.buf, KEY_BYTES);
    put_u32(at + 16, (uint32_t)header.len);
    put_u32(at + 20, (uint32_t)count);
    at += PREFIX_BYTES;
    for (Py_ssize_t i = 0; i < count; i++) {
        at[i] = kinds[i];
        put_u64(at + count + 8 * i, (uint64_t)views[i].len);
    }
    at += ENTRY_BYTES * count;
    memcpy(at, header.buf, header.len);
    at += header.len;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (kinds[i] == INLINE) {
            memcpy(at, views[i].buf, views[i].len);
            at += views[i].len;
        } else {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(bulk, index) < 0) {
                Py_XDECREF(index);
                goto done;
            }
            Py_DECREF(index);
        }
    }
    result = PyTuple_Pack(2, message, bulk);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(kinds);
    Py_XDECREF(sequence);
    Py_XDECREF(message);
    Py_XDECREF(bulk);
    PyBuffer_Release(&header);
    PyBuffer_Release(&key);
    return result;
}

/* decode(message, limit) -> (status, key, header, kinds, lengths, inline)
 *
 * wire.decode in C, with the same checks, in the same order, and the same errors:
 * ``inline`` holds a writable copy of each INLINE buffer (memoryviews of one bytearray).
 */
static PyObject *decode(PyObject *module, PyObject *args) {
    Py_buffer view;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "y*K", &view, &limit))
        return NULL;
    const unsigned char *at = view.buf;
    Py_ssize_t size = view.len;
    PyObject *result = NULL, *kinds = NULL, *lengths = NULL, *inline_buffers = NULL;
    PyObject *header = NULL, *key = NULL, *copy = NULL, *whole = NULL;
    if (size < PREFIX_BYTES) {
        PyErr_Format(InvalidArgumentError,
                     "Malformed frame: %zd bytes is shorter than a grpc+verbs prefix (%d bytes).",
                     size, PREFIX_BYTES);
        goto done;
    }
    if (memcmp(at, "CWV1", 4) != 0) {
        PyObject *magic = PyBytes_FromStringAndSize((const char *)at, 4);
        if (magic != NULL)
            PyErr_Format(InvalidArgumentError,
                         "Malformed frame: bad magic %R (not a grpc+verbs peer?).", magic);
        Py_XDECREF(magic);
        goto done;
    }
    uint32_t status = get_u32(at + 4), header_len = get_u32(at + 16), count = get_u32(at + 20);
    if (check_declared(count, header_len) < 0)
        goto done;
    Py_ssize_t start = PREFIX_BYTES + (Py_ssize_t)ENTRY_BYTES * count;
    if (size < start + (Py_ssize_t)header_len) {
        PyErr_Format(InvalidArgumentError,
                     "Malformed frame: %zd bytes, shorter than the %zd its buffer table and "
                     "header declare.", size, start + (Py_ssize_t)header_len);
        goto done;
    }
    if ((kinds = PyTuple_New(count)) == NULL || (lengths = PyTuple_New(count)) == NULL)
        goto done;
    unsigned max_kind = 0;
    uint64_t total = 0, inline_total = 0;
    int overflow = 0;
    const unsigned char *kind_column = at + PREFIX_BYTES, *length_column = kind_column + count;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t length = get_u64(length_column + 8 * (Py_ssize_t)i);
        max_kind = kind_column[i] > max_kind ? kind_column[i] : max_kind;
        overflow |= __builtin_add_overflow(total, length, &total);
        if (kind_column[i] == INLINE)
            overflow |= __builtin_add_overflow(inline_total, length, &inline_total);
        PyObject *kind = PyLong_FromLong(kind_column[i]);
        PyObject *nbytes = PyLong_FromUnsignedLongLong(length);
        if (kind == NULL || nbytes == NULL) {
            Py_XDECREF(kind);
            Py_XDECREF(nbytes);
            goto done;
        }
        PyTuple_SET_ITEM(kinds, i, kind);
        PyTuple_SET_ITEM(lengths, i, nbytes);
    }
    if (max_kind > BULK) {
        PyErr_Format(InvalidArgumentError, "Malformed frame: buffer kind %u (0 is inline, 1 bulk).",
                     max_kind);
        goto done;
    }
    if (overflow || total > limit) {
        /* The exact sum, as Python reports it, even past 64 bits. */
        PyObject *sum = PyLong_FromLong(0);
        for (uint32_t i = 0; sum != NULL && i < count; i++)
            Py_SETREF(sum, PyNumber_Add(sum, PyTuple_GET_ITEM(lengths, i)));
        if (sum != NULL)
            PyErr_Format(ResourceExhaustedError,
                         "Frame of %S bytes exceeds the limit of %llu bytes (max_message_bytes).",
                         sum, limit);
        Py_XDECREF(sum);
        goto done;
    }
    Py_ssize_t inline_start = start + header_len, inline_size = size - inline_start;
    if ((uint64_t)inline_size != inline_total) {
        PyErr_Format(InvalidArgumentError, "Malformed frame: %zd inline bytes, declared %llu.",
                     inline_size, (unsigned long long)inline_total);
        goto done;
    }
    if ((header = PyBytes_FromStringAndSize((const char *)at + start, header_len)) == NULL ||
        (key = PyBytes_FromStringAndSize((const char *)at + 8, KEY_BYTES)) == NULL ||
        (copy = PyByteArray_FromStringAndSize((const char *)at + inline_start, inline_size)) ==
            NULL ||
        (whole = PyMemoryView_FromObject(copy)) == NULL || (inline_buffers = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t offset = 0;
    for (uint32_t i = 0; i < count; i++) {
        if (PyLong_AsLong(PyTuple_GET_ITEM(kinds, i)) != INLINE)
            continue;
        Py_ssize_t length = (Py_ssize_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(lengths, i));
        PyObject *slice = PySequence_GetSlice(whole, offset, offset + length);
        if (slice == NULL || PyList_Append(inline_buffers, slice) < 0) {
            Py_XDECREF(slice);
            goto done;
        }
        Py_DECREF(slice);
        offset += length;
    }
    result = Py_BuildValue("(IOOOOO)", status, key, header, kinds, lengths, inline_buffers);
done:
    Py_XDECREF(kinds);
    Py_XDECREF(lengths);
    Py_XDECREF(inline_buffers);
    Py_XDECREF(header);
    Py_XDECREF(key);
    Py_XDECREF(copy);
    Py_XDECREF(whole);
    PyBuffer_Release(&view);
    return result;
}

/* send(endpoint, buffer, tag) -> pending handle (0: UCX finished it at once).
 *
 * The caller holds the UCX lock and has checked that ``endpoint`` is open; it
 * keeps ``buffer`` alive until ``test`` says the send finished.
 */
static PyObject *send(PyObject *module, PyObject *args) {
    PyObject *endpoint;
    Py_buffer view;
    unsigned long long tag;
    if (!PyArg_ParseTuple(args, "Oy*K", &endpoint, &view, &tag))
        return NULL;
    void *ep = endpoint_handle(endpoint);
    if (ep == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    ucp_request_param_t param;
    memset(&param, 0, sizeof param);
    void *sent = ucp.tag_send_nbx(ep, view.buf, view.len, tag, &param);
    PyBuffer_Release(&view);
    if (PTR_IS_ERR(sent))
        return ucx_error("UCX send failed", PTR_STATUS(sent));
    return PyLong_FromVoidPtr(sent);
}

/* Receive into ``taken`` the arrived messages matching ``tag``/``mask`` (all of them, or
 * ``once``: the first), as entries (watch, sender_tag, buffer, length, pending); see take.
 * Returns how many of those receives UCX has not finished; -1 on a Python error; -2 when
 * UCX refused a receive (``*failure`` says why; what was taken before stays in ``taken``). */
static int take_into(void *worker, Py_ssize_t watch, ucp_tag_t tag, ucp_tag_t mask,
                     Py_ssize_t limit, int once, PyObject *allocate, Py_ssize_t big,
                     PyObject *taken, const char **failure) {
    int unfinished = 0;
    for (;;) {
        ucp_tag_recv_info_t info;
        void *found = ucp.tag_probe_nb(worker, tag, mask, 1, &info);
        if (found == NULL)
            return unfinished;
        PyObject *buffer;
        void *pending;
        int begun = begin_receive(worker, found, info.length, limit,
                                  !once && (Py_ssize_t)info.length < big ? Py_None : allocate,
                                  &buffer, &pending, failure);
        if (begun < 0)
            return -2;
        unfinished += begun;
        PyObject *entry = Py_BuildValue("(nKNnK)", watch, (unsigned long long)info.sender_tag,
                                        buffer != NULL ? buffer : Py_NewRef(Py_None),
                                        (Py_ssize_t)info.length,
                                        (unsigned long long)(uintptr_t)pending);
        if (entry == NULL || PyList_Append(taken, entry) < 0) {
            Py_XDECREF(entry);
            return -1;
        }
        Py_DECREF(entry);
        if (once)
            return unfinished;
    }
}

/* A watch: (tag, mask, limit, once). */
static int parse_watch(PyObject *watch, ucp_tag_t *tag, ucp_tag_t *mask, Py_ssize_t *limit,
                       int *once) {
    unsigned long long t, m;
    if (!PyArg_ParseTuple(watch, "KKnp", &t, &m, limit, once))
        return -1;
    *tag = t, *mask = m;
    return 0;
}

/* take(worker, watch, allocate, big) -> (taken, failure): taken = [(0, sender_tag, buffer,
 * length, pending), ...]
 *
 * Receives the arrived messages matching ``watch`` = (tag, mask, limit, once):
 * all of them, or only the first if ``once``. Each is received into the
 * writable buffer ``allocate(length)`` returns (``buffer``), except that a
 * message under ``big`` bytes of a watch not ``once`` goes into new bytes. One over ``limit`` bytes, or one whose bytes could not be
 * allocated, is consumed unstored: ``buffer`` None, ``length`` its size.
 * ``pending`` is the handle of a receive UCX has not finished (0 if none;
 * ``test`` it, and leave ``buffer`` alone until then). ``failure`` is None, or
 * why UCX refused a receive (after the messages ``taken``). The caller holds the
 * UCX lock.
 */
static PyObject *take(PyObject *module, PyObject *args) {
    unsigned long long worker_h;
    PyObject *watch, *allocate;
    ucp_tag_t tag, mask;
    Py_ssize_t limit, big;
    int once;
    if (!PyArg_ParseTuple(args, "KOOn", &worker_h, &watch, &allocate, &big) ||
        parse_watch(watch, &tag, &mask, &limit, &once) < 0)
        return NULL;
    PyObject *taken = PyList_New(0);
    const char *failure = NULL;
    if (taken == NULL || take_into((void *)(uintptr_t)worker_h, 0, tag, mask, limit, once,
                                   allocate, big, taken, &failure) == -1) {
        Py_XDECREF(taken);
        return NULL;
    }
    return Py_BuildValue("(Nz)", taken, failure);
}

/* step(worker, watches, requests, allocate, big) -> (taken, finished, failure)
 *
 * Progresses ``worker`` until it is armed. Meanwhile it takes the messages of
 * each of ``watches`` (as ``take``; an entry's first item is the watch's
 * index) and tests the unfinished sends and receives whose handles are
 * ``requests``: ``finished`` lists (index, "" or the UCX error) of those that
 * finished (freed: test them no more). ``failure`` is None, or why UCX
 * refused a receive or to arm the worker: the step stopped there, and what it
 * took and finished is returned all the same. The caller holds the UCX lock.
 */
static PyObject *step(PyObject *module, PyObject *args) {
    unsigned long long worker_h;
    PyObject *watches, *requests, *allocate;
    Py_ssize_t big;
    if (!PyArg_ParseTuple(args, "KOOOn", &worker_h, &watches, &requests, &allocate, &big))
        return NULL;
    void *worker = (void *)(uintptr_t)worker_h;
    PyObject *watch_list = PySequence_Fast(watches, "watches must be a sequence");
    PyObject *request_list = PySequence_Fast(requests, "requests must be a sequence");
    PyObject *taken = PyList_New(0), *finished = PyList_New(0), *result = NULL;
    const char *failure = NULL;
    Py_ssize_t watch_count = watch_list == NULL ? 0 : PySequence_Fast_GET_SIZE(watch_list);
    Py_ssize_t request_count = request_list == NULL ? 0 : PySequence_Fast_GET_SIZE(request_list);
    char *done_watch = PyMem_Calloc(watch_count + 1, 1);
    char *done_request = PyMem_Calloc(request_count + 1, 1);
    if (watch_list == NULL || request_list == NULL || taken == NULL || finished == NULL ||
        done_watch == NULL || done_request == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto out;
    }
    for (;;) {
        while (ucp.worker_progress(worker) != 0) {
        }
        int unfinished = 0;
        for (Py_ssize_t i = 0; i < watch_count; i++) {
            ucp_tag_t tag, mask;
            Py_ssize_t limit;
            int once;
            if (done_watch[i])
                continue;
            if (parse_watch(PySequence_Fast_GET_ITEM(watch_list, i), &tag, &mask, &limit,
                            &once) < 0)
                goto out;
            Py_ssize_t before = PyList_GET_SIZE(taken);
            int begun = take_into(worker, i, tag, mask, limit, once, allocate, big, taken,
                                  &failure);
            if (begun == -1)
                goto out;
            if (begun == -2)
                break;
            unfinished += begun;
            done_watch[i] = once && PyList_GET_SIZE(taken) > before;
        }
        for (Py_ssize_t i = 0; i < request_count; i++) {
            if (done_request[i])
                continue;
            void *request = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(request_list, i));
            if (request == NULL && PyErr_Occurred())
                goto out;
            const char *outcome = finish(request);
            if (outcome == NULL)
                continue;
            done_request[i] = 1;
            PyObject *entry = Py_BuildValue("(ns)", i, outcome);
            if (entry == NULL || PyList_Append(finished, entry) < 0) {
                Py_XDECREF(entry);
                goto out;
            }
            Py_DECREF(entry);
        }
        if (failure != NULL)
            break;
        if (unfinished > 0)
            continue; /* a receive just begun may need progress that no event announces */
        ucs_status_t status = ucp.worker_arm(worker);
        if (status == UCS_OK)
            break;
        if (status != UCS_ERR_BUSY) {
            failure = ucp.status_string(status);
            break;
        }
    }
    result = Py_BuildValue("(OOz)", taken, finished, failure);
out:
    Py_XDECREF(watch_list);
    Py_XDECREF(request_list);
    Py_XDECREF(taken);
    Py_XDECREF(finished);
    PyMem_Free(done_watch);
    PyMem_Free(done_request);
    return result;
}

/* event_fd(worker) -> the descriptor UCX signals the armed worker's events on. */
static PyObject *event_fd(PyObject *module, PyObject *arg) {
    void *worker = PyLong_AsVoidPtr(arg);
    if (worker == NULL && PyErr_Occurred())
        return NULL;
    int fd;
    ucs_status_t status = ucp.worker_get_efd(worker, &fd);
    if (status != UCS_OK)
        return ucx_error("UCX has no event descriptor for the worker", status);
    return PyLong_FromLong(fd);
}

/* test(request) -> None while unfinished, else "" (success) or the UCX error.
 * Frees a finished request: test it no more then. */
static PyObject *test(PyObject *module, PyObject *arg) {
    void *request = PyLong_AsVoidPtr(arg);
    if (request == NULL && PyErr_Occurred())
        return NULL;
    const char *outcome = finish(request);
    if (outcome == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(outcome);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_NOARGS, "Resolve the UCP functions from the loaded libucp."},
    {"exchange", exchange, METH_VARARGS, "Send a small message and receive its reply."},
    {"encode", encode, METH_VARARGS, "A control message (wire.encode in C)."},
    {"decode", decode, METH_VARARGS, "Parse and check a control message (wire.decode in C)."},
    {"send", send, METH_VARARGS, "Send a buffer as one tagged message."},
    {"take", take, METH_VARARGS, "Receive every arrived message matching a tag."},
    {"step", step, METH_VARARGS, "Progress until armed, taking the matching messages."},
    {"event_fd", event_fd, METH_O, "The worker's event descriptor (ucp_worker_get_efd)."},
    {"test", test, METH_O, "Whether an unfinished send or receive has finished."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_ucp", "The small-call round trip of grpc+verbs, in C.", -1, methods,
};

/* MAX_BUFFERS and MAX_HEADER_BYTES of clusterwire.envelope: 0, or -1 with an error set. */
static int read_limits(void) {
    PyObject *envelope = PyImport_ImportModule("clusterwire.envelope");
    if (envelope == NULL)
        return -1;
    PyObject *buffers = PyObject_GetAttrString(envelope, "MAX_BUFFERS");
    PyObject *header = PyObject_GetAttrString(envelope, "MAX_HEADER_BYTES");
    Py_DECREF(envelope);
    if (buffers != NULL && header != NULL) {
        max_buffers = PyLong_AsUnsignedLongLong(buffers);
        max_header_bytes = PyLong_AsUnsignedLongLong(header);
    }
    Py_XDECREF(buffers);
    Py_XDECREF(header);
    return PyErr_Occurred() ? -1 : 0;
}

PyMODINIT_FUNC PyInit__ucp(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    UcxError = PyErr_NewException("clusterwire.transports.verbs._ucp.UcxError", NULL, NULL);
    acquire_name = PyUnicode_InternFromString("acquire");
    release_name = PyUnicode_InternFromString("release");
    closed_name = PyUnicode_InternFromString("closed");
    handle_name = PyUnicode_InternFromString("handle");
    stopping_name = PyUnicode_InternFromString("_stopping");
    PyObject *errors = PyImport_ImportModule("clusterwire.errors");
    if (errors != NULL) {
        InvalidArgumentError = PyObject_GetAttrString(errors, "InvalidArgumentError");
        ResourceExhaustedError = PyObject_GetAttrString(errors, "ResourceExhaustedError");
        Py_DECREF(errors);
    }
    if (read_limits() < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (InvalidArgumentError == NULL || ResourceExhaustedError == NULL || UcxError == NULL ||
        acquire_name == NULL || release_name == NULL || closed_name == NULL ||
        handle_name == NULL || stopping_name == NULL ||
        PyModule_AddObjectRef(module, "UcxError", UcxError) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    PyModule_AddIntConstant(module, "REPLIED", REPLIED);
    PyModule_AddIntConstant(module, "TIMED_OUT", TIMED_OUT);
    PyModule_AddIntConstant(module, "WATCHED", WATCHED);
    PyModule_AddIntConstant(module, "WOKEN", WOKEN);
    PyModule_AddIntConstant(module, "TOO_LONG", TOO_LONG);
    PyModule_AddIntConstant(module, "STOPPED", STOPPED);
    return module;
}
