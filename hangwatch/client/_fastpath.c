/* The hook's fast path in C: ``hangwatch.client.capture``'s wrapper for a call site that repeats
 * its call, with no Python bytecode run per call.
 *
 * Why native: every Python operation run between two collectives costs 4-10x its warm cost
 * (the collective's thread hand-off leaves the caches cold; BENCHMARKS.md "Where the calling
 * thread's cost goes"), and the Python fast path, which already does as little as a faithful
 * record allows, still added about 20 us per call on a 2-core VM. This file does the same steps
 * in the same order, writes the same two ring slots byte for byte, and hands every other case to
 * the Python wrapper (``general``): a first call, a call site that changed its arguments, async
 * calls, nested calls, Flight Recorder read in the rank, any error. The Python fast path in
 * ``capture.py`` stays the reference (and the fallback where this extension is not built);
 * ``tests/client/test_fastpath.py`` checks that both write the same slots.
 *
 * Nothing of the hook's own raises into the user's code: a failure before the user's call falls
 * back to ``general``; a failure after it is reported to the session (``on_exit_error``), and the
 * user's result or exception passes through untouched. What the program raises meanwhile (a
 * KeyboardInterrupt, what a signal handler raised in a callback: ``foreign_of``) is never
 * swallowed: it goes on to the program. The ring's slots are claimed and published in one step
 * (``claim_slot``), as a seqlock that holds on every CPU (``slot_publish``, ``slot_take``).
 * Everything here relies on the GIL: on a free-threaded interpreter the module refuses to load.
 *
 * The node agent's side lives here too (one extension, one build): ``scan_packed``, the loop over
 * a ring's slots of ``RingReader.poll``, and ``gather_packed``, ``RingEncoder._gather``'s
 * gathering of runs and cycles; each has its Python original as the reference and the fallback.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <frameobject.h>

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_READONLY READONLY
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's slots are little endian: build without the fast path"
#endif

/* One ring slot, as hangwatch.ring.SLOT ("<QBBHIIIIIdQ", 48 bytes) lays it out. */
#pragma pack(push, 1)
typedef struct {
    uint64_t stamp;
    uint8_t kind;
    uint8_t flags;
    uint16_t aux;
    uint32_t ref;
    uint32_t call_id;
    uint32_t seq;
    uint32_t step;
    uint32_t arg;
    double time;
    uint64_t stamp_end;
} slot_t;
#pragma pack(pop)

_Static_assert(sizeof(slot_t) == 48, "a ring slot is 48 bytes");

#define KIND_ENTER 1
#define KIND_EXIT 2

/* Threads inside a call the Python wrapper recorded (``general_entered``/``general_left``,
 * under the GIL): where none is, no call here can be nested in one, and the thread-local
 * ``depth`` (a threading.local lookup, about a tenth of this path's cost) is not read. */
static Py_ssize_t general_inside = 0;

/* ``hangwatch.ring.HEADER_SIZE``: where the slots begin (``ring.py`` checks it is the same). */
#define RING_HEADER 1024
/* ``hangwatch.ring._BLOB_USED_OFFSET``: blob_used, then blobs_dropped, then blob_count (u64 each). */
#define BLOB_USED_AT 40

static PyObject *s_zero, *s_one; /* what ``general_leave`` and ``general_enter`` set ``depth`` to */
static PyObject *s_active, *s_depth, *s_recorder, *s_memo, *s_covers, *s_sink, *s_mm, *s_positions,
    *s_capacity, *s_groups, *s_p2p_ops, *s_ids, *s_step, *s_shape, *s_dtype, *s_is_cuda;

typedef struct {
    PyObject_HEAD
    PyObject *spec;      /* the op's OpSpec: a memo entry is this op's only if it holds this object */
    Py_ssize_t k;        /* leading positional arguments that are the op's tensors */
    PyObject *original;  /* torch's function */
    PyObject *general;   /* the Python wrapper: every case this file does not serve */
    PyObject *globals;   /* capture's module dict: "_active" is the session */
    PyObject *tls;       /* capture's threading.local: "depth" is set inside a recorded call */
    PyObject *on_error;  /* on_error(session, spec, memo, call_id, seq, exc): the user's call raised */
    PyObject *on_exit_error; /* on_exit_error(session, exc): recording the exit failed */
    Py_ssize_t header;   /* ring.HEADER_SIZE */
    PyObject *dict;      /* __dict__: __wrapped__, __name__, __doc__... as functools.wraps sets them */
    /* What the session this wrapper last served holds; none of it is replaced in a session's
     * life (``Recorder.__init__``, ``RingSink.__init__``), so it is read again only when the
     * session changes. Strong references: a cached object's address cannot be reused. */
    PyObject *session, *recorder, *memos, *mm, *positions, *ids, *p2p;
    long long capacity;
    vectorcallfunc vectorcall;
    unsigned long long served; /* calls recorded here (tests and benches read it) */
} FastOp;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* what time.time() reads */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* An attribute as a C integer; -1 with an exception set on failure. */
static int attr_ll(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int next_ll(PyObject *it, long long *out) {
    PyObject *v = PyIter_Next(it);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "counter ended");
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* ---- the ring's publication protocol: a seqlock per slot (``hangwatch/ring.py`` says why) ----
 *
 * Writer: the front stamp, a release fence, the body, then the end stamp by a store-release.
 * Reader: the end stamp by a load-acquire, the body, an acquire fence, then the front stamp; the
 * slot is whole when both stamps are the one it wants. Every word is an atomic access of its own
 * (relaxed where no order is asked), so neither the compiler nor a weakly ordered CPU may move
 * one across the fences. On x86-64 the fences and the acquire/release accesses are plain moves. */

/* Between two steps of the reader (tests only: they play interleavings by hand); NULL otherwise. */
typedef void (*step_fn)(void *arg, int step);

static inline void slot_publish(char *dst, const slot_t *slot) {
    uint64_t w[6];
    memcpy(w, slot, sizeof w);
    uint64_t *q = (uint64_t *)(void *)dst;
    __atomic_store_n(&q[0], w[0], __ATOMIC_RELAXED); /* front stamp: the slot is being written */
    __atomic_thread_fence(__ATOMIC_RELEASE);         /* ... before any of its body is */
    for (int i = 1; i < 5; i++) __atomic_store_n(&q[i], w[i], __ATOMIC_RELAXED);
    __atomic_store_n(&q[5], w[5], __ATOMIC_RELEASE); /* end stamp: after the whole body */
}

/* The slot at ``src`` into ``out``; 1 where both its stamps are ``want`` (whole), else 0. */
static inline int slot_take(const char *src, uint64_t want, slot_t *out, step_fn between, void *arg) {
    const uint64_t *q = (const uint64_t *)(const void *)src;
    uint64_t w[6];
    w[5] = __atomic_load_n(&q[5], __ATOMIC_ACQUIRE); /* end stamp first: the body it closes is seen */
    if (between != NULL) between(arg, 0);
    for (int i = 1; i < 5; i++) w[i] = __atomic_load_n(&q[i], __ATOMIC_RELAXED);
    if (between != NULL) between(arg, 1);
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the body's loads before the front stamp's */
    w[0] = __atomic_load_n(&q[0], __ATOMIC_RELAXED); /* a writer that began since shows here */
    memcpy(out, w, sizeof w);
    return w[0] == want && w[5] == want;
}

/* The ring's slot area in ``view`` (8-byte aligned, as the protocol's words must be); NULL with
 * an exception where the mapping is smaller than the ring. */
static char *ring_slots(Py_buffer *view, Py_ssize_t header, long long capacity) {
    if (capacity <= 0 || header < 0 || capacity > (PY_SSIZE_T_MAX - header) / (Py_ssize_t)sizeof(slot_t) ||
        header + (Py_ssize_t)capacity * (Py_ssize_t)sizeof(slot_t) > view->len) {
        PyErr_SetString(PyExc_ValueError, "the ring is larger than its mapping");
        return NULL;
    }
    char *base = (char *)view->buf + header;
    if (((uintptr_t)base & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "the ring's slots are not 8-byte aligned");
        return NULL;
    }
    return base;
}

/* Claim the next slot from ``positions`` and publish ``slot`` there, in one step: nothing that can
 * fail comes between the claim and the write, and no Python code runs there (no signal handler
 * can leave a claimed slot unwritten). The position is ``*h``. -1 with an exception on failure,
 * before anything was claimed. */
static int claim_slot(PyObject *mm, PyObject *positions, Py_ssize_t header, long long capacity, slot_t *slot,
                      long long *h) {
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE) < 0) return -1;
    char *base = ring_slots(&view, header, capacity);
    if (base == NULL || next_ll(positions, h) < 0) {
        PyBuffer_Release(&view);
        return -1;
    }
    if (*h < 0) { /* a counter moved by hand: nothing written */
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "bad ring position");
        return -1;
    }
    slot->stamp = slot->stamp_end = (uint64_t)*h + 1;
    slot_publish(base + (Py_ssize_t)(*h % capacity) * (Py_ssize_t)sizeof(slot_t), slot);
    PyBuffer_Release(&view);
    return 0;
}

/* The exception being raised, taken (as a new reference), and the same put back. */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void give_exception(PyObject *exc) { /* steals ``exc`` */
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    if (exc == NULL) return;
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* ``hangwatch.native.foreign``: whether an exception is the program's (set by ``set_foreign``). */
static PyObject *foreign_fn = NULL;

/* The exception to pass on to the program where ``exc`` (borrowed, none set) is not the hook's
 * own (a KeyboardInterrupt, what a signal handler raised), or a newer one a signal handler raised
 * while this was asked, with ``exc`` as its context: a new reference. NULL where ``exc`` is the
 * hook's own, to swallow (the hook copes, or turns itself off and says so). */
static PyObject *foreign_of(PyObject *exc) {
    if (exc == NULL) return NULL;
    if (!PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_Exception)) return Py_NewRef(exc);
    if (foreign_fn == NULL) return NULL;
    PyObject *r = PyObject_CallOneArg(foreign_fn, exc);
    if (r == NULL) { /* ``foreign`` never raises: a signal handler did, inside it */
        PyObject *newer = take_exception();
        if (newer != NULL && newer != exc) PyException_SetContext(newer, Py_NewRef(exc));
        return newer;
    }
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (t < 0) PyErr_Clear();
    return t > 0 ? Py_NewRef(exc) : NULL;
}

static int truthy_attr(PyObject *obj, PyObject *name) {
    /* 1 true, 0 false or absent, -1 error */
    PyObject *v;
#if PY_VERSION_HEX >= 0x030D0000
    if (PyObject_GetOptionalAttr(obj, name, &v) < 0) return -1;
#else
    if (_PyObject_LookupAttr(obj, name, &v) < 0) return -1;
#endif
    if (v == NULL) return 0;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Whether the call matches ``memo`` (1), does not (0), or the check failed (-1). */
static int matches(FastOp *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                   PyObject *const *kwvalues, PyObject *memo) {
    if (PyTuple_GET_ITEM(memo, 0) != self->spec) return 0;
    int t = PyObject_IsTrue(PyTuple_GET_ITEM(memo, 7)); /* async: the general path */
    if (t != 0) return t < 0 ? -1 : 0;
    PyObject *rest = PyTuple_GET_ITEM(memo, 1);
    if (!PyTuple_Check(rest) || PyTuple_GET_SIZE(rest) != nargs - self->k) return 0;
    for (Py_ssize_t i = self->k; i < nargs; i++) {
        PyObject *a = args[i], *b = PyTuple_GET_ITEM(rest, i - self->k);
        if (a == b) continue;
        int eq = PyObject_RichCompareBool(a, b, Py_EQ);
        if (eq != 1) return eq;
    }
    PyObject *kw = PyTuple_GET_ITEM(memo, 2);
    if (!PyDict_Check(kw)) return 0;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (PyDict_GET_SIZE(kw) != nkw) return 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *want = PyDict_GetItemWithError(kw, PyTuple_GET_ITEM(kwnames, i));
        if (want == NULL) return PyErr_Occurred() ? -1 : 0;
        if (want == kwvalues[i]) continue;
        int eq = PyObject_RichCompareBool(kwvalues[i], want, Py_EQ);
        if (eq != 1) return eq;
    }
    PyObject *metas = PyTuple_GET_ITEM(memo, 3);
    if (!PyTuple_Check(metas) || PyTuple_GET_SIZE(metas) < self->k) return 0;
    for (Py_ssize_t i = 0; i < self->k; i++) {
        PyObject *meta = PyTuple_GET_ITEM(metas, i);
        if (!PyTuple_Check(meta) || PyTuple_GET_SIZE(meta) != 3) return 0;
        PyObject *v = PyObject_GetAttr(args[i], s_dtype);
        if (v == NULL) return -1;
        int same = v == PyTuple_GET_ITEM(meta, 1);
        Py_DECREF(v);
        if (!same) return 0;
        v = PyObject_GetAttr(args[i], s_is_cuda);
        if (v == NULL) return -1;
        same = v == PyTuple_GET_ITEM(meta, 2);
        Py_DECREF(v);
        if (!same) return 0;
        v = PyObject_GetAttr(args[i], s_shape);
        if (v == NULL) return -1;
        int eq = PyObject_RichCompareBool(v, PyTuple_GET_ITEM(meta, 0), Py_EQ);
        Py_DECREF(v);
        if (eq != 1) return eq;
    }
    return 1;
}

static PyObject *call_general(FastOp *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
}

static void forget_session(FastOp *self) {
    Py_CLEAR(self->session);
    Py_CLEAR(self->recorder);
    Py_CLEAR(self->memos);
    Py_CLEAR(self->mm);
    Py_CLEAR(self->positions);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->p2p);
    self->capacity = 0;
}

/* Read what ``session`` holds into the cache; -1 with an exception on failure (cache cleared). */
static int learn_session(FastOp *self, PyObject *session) {
    forget_session(self);
    PyObject *sink = NULL, *groups = NULL;
    self->recorder = PyObject_GetAttr(session, s_recorder);
    if (self->recorder == NULL) goto fail;
    self->memos = PyObject_GetAttr(self->recorder, s_memo);
    if (self->memos == NULL) goto fail;
    if (!PyDict_Check(self->memos)) {
        PyErr_SetString(PyExc_TypeError, "recorder.memo is not a dict");
        goto fail;
    }
    sink = PyObject_GetAttr(self->recorder, s_sink);
    if (sink == NULL) goto fail;
    self->mm = PyObject_GetAttr(sink, s_mm);
    if (self->mm == NULL) goto fail;
    self->positions = PyObject_GetAttr(sink, s_positions);
    if (self->positions == NULL || attr_ll(sink, s_capacity, &self->capacity) < 0) goto fail;
    self->ids = PyObject_GetAttr(self->recorder, s_ids);
    if (self->ids == NULL) goto fail;
    groups = PyObject_GetAttr(self->recorder, s_groups);
    if (groups == NULL) goto fail;
    self->p2p = PyObject_GetAttr(groups, s_p2p_ops);
    if (self->p2p == NULL) goto fail;
    if (!PyDict_Check(self->p2p)) {
        PyErr_SetString(PyExc_TypeError, "p2p_ops is not a dict");
        goto fail;
    }
    Py_DECREF(sink);
    Py_DECREF(groups);
    self->session = Py_NewRef(session);
    return 0;
fail:
    Py_XDECREF(sink);
    Py_XDECREF(groups);
    forget_session(self);
    return -1;
}

static PyObject *fastop_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    FastOp *self = (FastOp *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *session = PyDict_GetItemWithError(self->globals, s_active); /* borrowed */
    if (session == NULL || session == Py_None) {
        PyErr_Clear();
        if (self->session != NULL) forget_session(self); /* let a finished session go */
        return call_general(self, args, nargsf, kwnames);
    }
    if (nargs < self->k) return call_general(self, args, nargsf, kwnames);
    if (session != self->session && learn_session(self, session) < 0) {
        PyObject *exc = take_exception(), *pass = foreign_of(exc);
        Py_XDECREF(exc);
        if (pass != NULL) {
            give_exception(pass);
            return NULL;
        }
        return call_general(self, args, nargsf, kwnames);
    }
    /* held for the call: the cache may be refilled by a nested or concurrent call meanwhile */
    PyObject *recorder = Py_NewRef(self->recorder), *memos = Py_NewRef(self->memos), *mm = Py_NewRef(self->mm),
             *positions = Py_NewRef(self->positions), *ids = Py_NewRef(self->ids), *p2p = Py_NewRef(self->p2p),
             *memo = NULL, *key = NULL;
    long long seq = 0, call_id = 0, step = 0, capacity = self->capacity, h = 0, ref = 0, p2p_ops = 0;
    int served = 0;
    Py_INCREF(session);

    if (general_inside > 0 && truthy_attr(self->tls, s_depth) != 0)
        goto done; /* inside another recorded call (or failed) */
    PyFrameObject *frame = PyEval_GetFrame(); /* the caller's: this callable pushes no frame */
    if (frame == NULL) goto done;
    PyCodeObject *code = PyFrame_GetCode(frame); /* new reference */
#if PY_VERSION_HEX >= 0x030B0000
    int lasti = PyFrame_GetLasti(frame);
#else
    int lasti = frame->f_lasti * (int)sizeof(_Py_CODEUNIT); /* what frame.f_lasti says on 3.10 */
#endif
    Py_DECREF(code); /* the frame holds it; only compared below */
    if (lasti < 0 || lasti >= (1 << 16)) goto done;
    /* recorder.memo_key(code, lasti): id(code) << 16 | lasti */
    key = PyLong_FromUnsignedLongLong(((unsigned long long)(uintptr_t)code << 16) | (unsigned long long)lasti);
    if (key == NULL) goto done;
    memo = PyDict_GetItemWithError(memos, key);
    if (memo == NULL) goto done;
    Py_INCREF(memo);
    if (!PyTuple_Check(memo) || PyTuple_GET_SIZE(memo) != 10 || PyTuple_GET_ITEM(memo, 8) != (PyObject *)code)
        goto done; /* another code object that had the same address: not this call site's */
    if (truthy_attr(recorder, s_covers) != 0) goto done; /* Flight Recorder read in the rank: general */
    if (matches(self, args, nargs, kwnames, args + nargs, memo) != 1) goto done;
    /* the seq torch gives this call on its group, net of the group's p2p ops (as ``enter``) */
    PyObject *seqobj = PyObject_CallNoArgs(PyTuple_GET_ITEM(memo, 9));
    if (seqobj == NULL) goto done;
    seq = PyLong_AsLongLong(seqobj);
    Py_DECREF(seqobj);
    if (seq == -1 && PyErr_Occurred()) goto done;
    PyObject *issued = PyDict_GetItemWithError(p2p, PyTuple_GET_ITEM(memo, 5));
    if (issued == NULL && PyErr_Occurred()) goto done;
    if (issued != NULL) {
        p2p_ops = PyLong_AsLongLong(issued);
        if (p2p_ops == -1 && PyErr_Occurred()) goto done;
    }
    seq = seq - p2p_ops + 1;
    ref = PyLong_AsLongLong(PyTuple_GET_ITEM(memo, 6));
    if (ref == -1 && PyErr_Occurred()) goto done;
    if (attr_ll(recorder, s_step, &step) < 0) goto done;
    if (next_ll(ids, &call_id) < 0) goto done;
    slot_t slot = {0};
    slot.kind = KIND_ENTER;
    slot.ref = (uint32_t)ref;
    slot.call_id = (uint32_t)call_id;
    slot.seq = (uint32_t)seq;
    slot.step = (uint32_t)step;
    slot.time = now_s();
    if (claim_slot(mm, positions, self->header, capacity, &slot, &h) < 0) goto done;
    served = 1;

done:
    Py_XDECREF(key);
    Py_DECREF(memos);
    Py_DECREF(ids);
    Py_DECREF(p2p);
    if (!served) {
        /* the general path records the call, or fails once and says so; but what a signal
         * handler raised in a callback above (or a KeyboardInterrupt) is the program's */
        PyObject *pass = NULL;
        if (PyErr_Occurred()) {
            PyObject *exc = take_exception();
            pass = foreign_of(exc);
            Py_XDECREF(exc);
        }
        Py_XDECREF(memo);
        Py_DECREF(recorder);
        Py_DECREF(mm);
        Py_DECREF(positions);
        Py_DECREF(session);
        if (pass != NULL) {
            give_exception(pass);
            return NULL;
        }
        return call_general(self, args, nargsf, kwnames);
    }
    self->served++;
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL) {
        /* the user's call raised: its exit recorded with the error, then the error passes on
         * (or what a signal handler raised meanwhile, with the call's error as its context) */
        PyObject *exc = take_exception();
        PyObject *r = PyObject_CallFunction(self->on_error, "OOOLLO", session, self->spec, memo, call_id, seq, exc);
        if (r == NULL) {
            PyObject *inner = take_exception();
            PyObject *pass = foreign_of(inner);
            Py_XDECREF(inner);
            if (pass != NULL) {
                if (pass != exc) PyException_SetContext(pass, exc); /* steals exc */
                else Py_DECREF(exc);
                exc = pass;
            }
        }
        Py_XDECREF(r);
        give_exception(exc);
    } else {
        long long h2 = 0;
        slot_t out = {0};
        out.kind = KIND_EXIT;
        out.aux = 1;
        out.call_id = (uint32_t)call_id;
        out.time = now_s();
        if (claim_slot(mm, positions, self->header, capacity, &out, &h2) < 0) {
            PyObject *exc = take_exception();
            PyObject *r = PyObject_CallFunctionObjArgs(self->on_exit_error, session, exc, NULL);
            Py_XDECREF(exc);
            if (r == NULL) {
                PyObject *inner = take_exception();
                PyObject *pass = foreign_of(inner);
                Py_XDECREF(inner);
                if (pass != NULL) { /* a signal handler's exception while it was said: the program's */
                    Py_CLEAR(result);
                    give_exception(pass);
                }
            }
            Py_XDECREF(r);
        }
    }
    Py_DECREF(memo);
    Py_DECREF(recorder);
    Py_DECREF(mm);
    Py_DECREF(positions);
    Py_DECREF(session);
    return result;
}

static PyObject *fastop_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"spec", "k", "original", "general", "globals", "tls", "on_error", "on_exit_error",
                            "header", NULL};
    PyObject *spec, *original, *general, *globals, *tls, *on_error, *on_exit_error;
    Py_ssize_t k, header;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnOOO!OOOn", names, &spec, &k, &original, &general,
                                     &PyDict_Type, &globals, &tls, &on_error, &on_exit_error, &header))
        return NULL;
    if (k < 0 || header < 0) {
        PyErr_SetString(PyExc_ValueError, "k and header must be >= 0");
        return NULL;
    }
    FastOp *self = (FastOp *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->spec = Py_NewRef(spec);
    self->k = k;
    self->original = Py_NewRef(original);
    self->general = Py_NewRef(general);
    self->globals = Py_NewRef(globals);
    self->tls = Py_NewRef(tls);
    self->on_error = Py_NewRef(on_error);
    self->on_exit_error = Py_NewRef(on_exit_error);
    self->header = header;
    self->dict = NULL;
    self->session = self->recorder = self->memos = self->mm = self->positions = self->ids = self->p2p = NULL;
    self->capacity = 0;
    self->vectorcall = fastop_vectorcall;
    self->served = 0;
    return (PyObject *)self;
}

static int fastop_traverse(FastOp *self, visitproc visit, void *arg) {
    Py_VISIT(self->spec);
    Py_VISIT(self->original);
    Py_VISIT(self->general);
    Py_VISIT(self->globals);
    Py_VISIT(self->tls);
    Py_VISIT(self->on_error);
    Py_VISIT(self->on_exit_error);
    Py_VISIT(self->dict);
    Py_VISIT(self->session);
    Py_VISIT(self->recorder);
    Py_VISIT(self->memos);
    Py_VISIT(self->mm);
    Py_VISIT(self->positions);
    Py_VISIT(self->ids);
    Py_VISIT(self->p2p);
    return 0;
}

static int fastop_clear(FastOp *self) {
    Py_CLEAR(self->spec);
    Py_CLEAR(self->original);
    Py_CLEAR(self->general);
    Py_CLEAR(self->globals);
    Py_CLEAR(self->tls);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->on_exit_error);
    Py_CLEAR(self->dict);
    forget_session(self);
    return 0;
}

static void fastop_dealloc(FastOp *self) {
    PyObject_GC_UnTrack(self);
    fastop_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Bound like a function: ``obj.all_reduce`` of a class that holds it passes ``obj`` first. */
static PyObject *fastop_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* Pickled by name, as the function it stands for is. */
static PyObject *fastop_reduce(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyObject *fastop_served(FastOp *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->served);
}

static PyObject *fastop_forget(FastOp *self, PyObject *unused) {
    (void)unused;
    forget_session(self);
    Py_RETURN_NONE;
}

static PyMethodDef fastop_methods[] = {
    {"__reduce__", fastop_reduce, METH_NOARGS, NULL},
    {"forget", (PyCFunction)fastop_forget, METH_NOARGS, "let go of the session this wrapper last served"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef fastop_members[] = {
    {"__dictoffset__", Py_T_PYSSIZET, offsetof(FastOp, dict), Py_READONLY, NULL},
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(FastOp, vectorcall), Py_READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef fastop_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"served", (getter)fastop_served, NULL, "calls this wrapper recorded itself", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FastOpType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hangwatch.client._fastpath.FastOp",
    .tp_basicsize = sizeof(FastOp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A recorded torch.distributed function whose repeated calls are recorded in C.",
    .tp_new = fastop_new,
    .tp_dealloc = (destructor)fastop_dealloc,
    .tp_traverse = (traverseproc)fastop_traverse,
    .tp_clear = (inquiry)fastop_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastOp, vectorcall),
    .tp_descr_get = fastop_descr_get,
    .tp_dictoffset = offsetof(FastOp, dict),
    .tp_methods = fastop_methods,
    .tp_members = fastop_members,
    .tp_getset = fastop_getset,
};

/* ---- the node agent's side: a read's slots gathered into runs and cycles -------------------
 *
 * ``hangwatch.ringwire.RingEncoder._gather`` then ``_cycled`` step for step (the Python ones
 * stay the reference and the fallback; ``tests/test_ringwire.py`` plays them on the same
 * batches). Slots are ``hangwatch.ring.RingSlot`` tuples where the caller has them: (stamp, kind,
 * flags, aux, ref, call_id, seq, step, arg, time, stamp_end). */

#define F_KIND 1
#define F_FLAGS 2
#define F_AUX 3
#define F_REF 4
#define F_CALL 5
#define F_SEQ 6
#define F_STEP 7
#define F_TIME 9

/* The period (0: none) of the longest cycle of 2 to ``max_cycle`` refs, repeated ``cycle_min``
 * times or more, that ``refs[i:m]`` starts with, and its length in calls (``*len``). */
static Py_ssize_t best_cycle(const unsigned long *refs, Py_ssize_t i, Py_ssize_t m, Py_ssize_t cycle_min,
                             Py_ssize_t max_cycle, Py_ssize_t *len) {
    Py_ssize_t best_p = 0, best_len = 0;
    for (Py_ssize_t p = 2; p <= max_cycle; p++) {
        if (i + cycle_min * p > m) break;
        Py_ssize_t length = p;
        while (i + length < m && refs[i + length] == refs[i + length - p]) length++;
        int varied = 0;
        for (Py_ssize_t q = i + 1; q < i + p; q++)
            if (refs[q] != refs[i]) varied = 1;
        if (length >= cycle_min * p && length > best_len && varied) {
            best_p = p;
            best_len = length;
        }
    }
    *len = best_len;
    return best_p;
}

/* ---- packed slots: a read's slots as one bytes object, gathered without a tuple per slot -----
 *
 * A scan that made an 11-tuple (and five numbers) per slot had most of them gone again a moment
 * later, folded into a run's list of times: at 1,000 calls a second it cost the embedded agent
 * about 0.35 us a slot on this VM's cold caches, a third of its cost per read (measured in the
 * coordinator, 2026-11-24: BENCHMARKS.md, issue 16's fifth step). ``scan_packed`` copies the
 * published slots out as they lie, one bytes object; ``gather_packed`` gathers runs, and cycles
 * where asked, straight from those bytes, and makes a slot's tuple only where the slot travels
 * alone or opens a run. Slots already made tuples (a list: the entry held back, a test's batch)
 * go in as its ``head``, with no bytes. */

/* scan_packed(mm, header, capacity, position, budget) -> (data, position, stopped): the slots
 * published from ``position`` on, oldest first, at most ``budget``, as one bytes object
 * (SLOT_SIZE bytes each, as the ring lays them out); ``stopped`` is None where the budget ended
 * the scan, else the (stamp, stamp_end) of the slot that did: not written yet, being written,
 * or lapped (the caller skips ahead). A slot is taken when both its stamps say ``position + 1``
 * as the protocol reads them (``slot_take``): published whole, and not overwritten meanwhile. */
static PyObject *scan_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scan_packed(mm, header, capacity, position, budget)");
        return NULL;
    }
    Py_ssize_t header = PyLong_AsSsize_t(args[1]);
    long long capacity = PyLong_AsLongLong(args[2]);
    long long p = PyLong_AsLongLong(args[3]);
    Py_ssize_t budget = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (capacity <= 0 || p < 0 || header < 0 || budget < 0) {
        PyErr_SetString(PyExc_ValueError, "scan_packed: bad ring geometry");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *base = ring_slots(&view, header, capacity);
    if (base == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t room = budget < 256 ? budget : 256, n = 0;
    slot_t *buf = PyMem_Malloc(sizeof(slot_t) * (size_t)(room > 0 ? room : 1));
    PyObject *stopped = NULL, *data = NULL;
    if (buf == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    while (n < budget) {
        if (n == room) {
            Py_ssize_t more = room * 2 < budget ? room * 2 : budget;
            slot_t *bigger = PyMem_Realloc(buf, sizeof(slot_t) * (size_t)more);
            if (bigger == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            buf = bigger;
            room = more;
        }
        slot_t *s = &buf[n];
        if (!slot_take(base + (Py_ssize_t)(p % capacity) * (Py_ssize_t)sizeof(slot_t), (uint64_t)p + 1, s, NULL,
                       NULL)) {
            stopped = Py_BuildValue("(KK)", (unsigned long long)s->stamp, (unsigned long long)s->stamp_end);
            if (stopped == NULL) goto fail;
            break;
        }
        n++;
        p++;
    }
    data = PyBytes_FromStringAndSize((const char *)buf, n * (Py_ssize_t)sizeof(slot_t));
    if (data == NULL) goto fail;
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return Py_BuildValue("(NLN)", data, p, stopped != NULL ? stopped : Py_NewRef(Py_None));
fail:
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    Py_XDECREF(stopped);
    return NULL;
}

/* What ``gather_packed`` works on: the batch's slots as structs, each one's tuple where it has
 * one (a slot held back from the last batch) or once one was made (``g_slot``). */
typedef struct {
    slot_t *s;
    PyObject **obj; /* owned references, NULL until made */
    Py_ssize_t n;
    PyTypeObject *slot_type;
    /* the refs' numbers met so far (a batch names few signatures): owned references */
    unsigned long ref_key[16];
    PyObject *ref_obj[16];
    int refs;
} gsrc_t;

#define G_SLOT 0
#define G_RUN 1
#define G_CYCLE 2

typedef struct {
    int type;
    Py_ssize_t i; /* the slot (G_SLOT), or the first call's ENTER slot (runs, cycles) */
    Py_ssize_t k; /* calls (runs, cycles) */
    Py_ssize_t p; /* a cycle's period */
} gitem_t;

typedef struct {
    gitem_t *items;
    Py_ssize_t n, room;
} gitems_t;

static int gitems_add(gitems_t *out, int type, Py_ssize_t i, Py_ssize_t k, Py_ssize_t p) {
    if (out->n == out->room) {
        Py_ssize_t more = out->room ? out->room * 2 : 64;
        gitem_t *bigger = PyMem_Realloc(out->items, sizeof(gitem_t) * (size_t)more);
        if (bigger == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        out->items = bigger;
        out->room = more;
    }
    out->items[out->n++] = (gitem_t){type, i, k, p};
    return 0;
}

/* A ref's number as a Python int (a new reference); NULL with an exception on failure. */
static PyObject *g_ref(gsrc_t *src, unsigned long ref) {
    for (int j = 0; j < src->refs; j++)
        if (src->ref_key[j] == ref) return Py_NewRef(src->ref_obj[j]);
    PyObject *o = PyLong_FromUnsignedLong(ref);
    if (o != NULL && src->refs < 16) {
        src->ref_key[src->refs] = ref;
        src->ref_obj[src->refs++] = Py_NewRef(o);
    }
    return o;
}

/* Slot ``i``'s tuple (borrowed: ``src`` holds it); NULL with an exception on failure. */
static PyObject *g_slot(gsrc_t *src, Py_ssize_t i) {
    if (src->obj[i] != NULL) return src->obj[i];
    const slot_t *s = &src->s[i];
    PyObject *o = src->slot_type->tp_alloc(src->slot_type, 11);
    if (o == NULL) return NULL;
    PyObject *v[11] = {
        PyLong_FromUnsignedLongLong(s->stamp), PyLong_FromUnsignedLong(s->kind),
        PyLong_FromUnsignedLong(s->flags),     PyLong_FromUnsignedLong(s->aux),
        g_ref(src, s->ref),                    PyLong_FromUnsignedLong(s->call_id),
        PyLong_FromUnsignedLong(s->seq),       PyLong_FromUnsignedLong(s->step),
        PyLong_FromUnsignedLong(s->arg),       PyFloat_FromDouble(s->time),
        PyLong_FromUnsignedLongLong(s->stamp_end),
    };
    int bad = 0;
    for (int j = 0; j < 11; j++) {
        if (v[j] == NULL) bad = 1;
        PyTuple_SET_ITEM(o, j, v[j]);
    }
    if (bad) {
        Py_DECREF(o);
        return NULL;
    }
    PyObject_GC_UnTrack(o); /* numbers only: in no cycle, and the collector need not visit it */
    src->obj[i] = o;
    return o;
}

/* A Slot tuple (held back from the last batch) as a struct; -1 with an exception on failure. */
static int g_from_tuple(PyObject *t, slot_t *s) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 11) {
        PyErr_SetString(PyExc_TypeError, "gather_packed: a held slot is not an 11-tuple");
        return -1;
    }
    unsigned long long v[11];
    for (int j = 0; j < 11; j++) {
        if (j == F_TIME) continue;
        v[j] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, j));
        if (v[j] == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    }
    double time = PyFloat_AsDouble(PyTuple_GET_ITEM(t, F_TIME));
    if (time == -1.0 && PyErr_Occurred()) return -1;
    s->stamp = v[0];
    s->kind = (uint8_t)v[F_KIND];
    s->flags = (uint8_t)v[F_FLAGS];
    s->aux = (uint16_t)v[F_AUX];
    s->ref = (uint32_t)v[F_REF];
    s->call_id = (uint32_t)v[F_CALL];
    s->seq = (uint32_t)v[F_SEQ];
    s->step = (uint32_t)v[F_STEP];
    s->arg = (uint32_t)v[8];
    s->time = time;
    s->stamp_end = v[10];
    return 0;
}

/* ``ok[ref]`` is true: 1, 0, -1 on failure. */
static int g_ok(gsrc_t *src, PyObject *ok, unsigned long ref) {
    PyObject *key = g_ref(src, ref);
    if (key == NULL) return -1;
    PyObject *may = PyDict_GetItemWithError(ok, key);
    Py_DECREF(key);
    if (may == NULL) return PyErr_Occurred() ? -1 : 0;
    return PyObject_IsTrue(may);
}

static int g_in(gsrc_t *src, PyObject *set, unsigned long ref) {
    PyObject *key = g_ref(src, ref);
    if (key == NULL) return -1;
    int in = PySet_Contains(set, key);
    Py_DECREF(key);
    return in;
}

/* Whether slot ``s`` (with ``after``, the next one or NULL) tells a detector nothing it waits
 * for (``ringwire._settled``). */
static int g_settled(const slot_t *s, const slot_t *after) {
    if (s->kind == KIND_ENTER)
        return after != NULL && !(s->flags & 1) && after->kind == KIND_EXIT && after->call_id == s->call_id &&
               after->ref == 0;
    if (s->kind == KIND_EXIT) return s->ref == 0;
    return s->kind == 3;
}

/* ``RingEncoder._gather_python``'s loop: runs and lone slots into ``out``; the batch's steadiness. */
static int g_gather(gsrc_t *src, PyObject *whole, PyObject *ok, PyObject *known, Py_ssize_t run_min, gitems_t *out,
                    int *steady_out) {
    const slot_t *S = src->s;
    Py_ssize_t n = src->n, i = 0, run_i = -1, run_k = 0;
    int steady = n > 0;
#define FLUSH()                                                                       \
    do {                                                                              \
        if (run_i >= 0) {                                                             \
            if (run_k >= run_min) {                                                   \
                if (gitems_add(out, G_RUN, run_i, run_k, 0) < 0) return -1;           \
            } else {                                                                  \
                for (Py_ssize_t q = 0; q < 2 * run_k; q++)                            \
                    if (gitems_add(out, G_SLOT, run_i + q, 0, 0) < 0) return -1;      \
            }                                                                         \
            run_i = -1;                                                               \
            run_k = 0;                                                                \
        }                                                                             \
    } while (0)
    while (i < n) {
        const slot_t *s = &S[i];
        if (s->kind == KIND_ENTER && i + 1 < n && !(s->flags & 1)) {
            int in_whole = g_in(src, whole, s->ref);
            if (in_whole < 0) return -1;
            if (!in_whole) { /* a signature not shown before: it travels alone */
                steady = 0;
                PyObject *key = g_ref(src, s->ref);
                if (key == NULL) return -1;
                PyObject *r = PyObject_CallOneArg(known, key);
                if (r == NULL) {
                    Py_DECREF(key);
                    return -1;
                }
                Py_DECREF(r);
                int t = g_ok(src, ok, s->ref);
                if (t < 0 || (t && PySet_Add(whole, key) < 0)) {
                    Py_DECREF(key);
                    return -1;
                }
                Py_DECREF(key);
                FLUSH();
                if (gitems_add(out, G_SLOT, i, 0, 0) < 0) return -1;
                i += 1;
                continue;
            }
            int t = g_ok(src, ok, s->ref);
            if (t < 0) return -1;
            const slot_t *x = &S[i + 1];
            if (t && x->kind == KIND_EXIT && x->call_id == s->call_id && x->ref == 0 && x->aux <= 1) {
                const slot_t *r0 = run_i >= 0 ? &S[run_i] : NULL;
                int follows = r0 != NULL && s->ref == r0->ref &&
                              s->call_id == (uint32_t)(r0->call_id + (uint32_t)run_k) &&
                              s->seq == (uint32_t)(r0->seq + (uint32_t)run_k) && s->step == r0->step;
                if (!follows) {
                    FLUSH();
                    run_i = i;
                }
                run_k++;
                i += 2;
                continue;
            }
        }
        FLUSH();
        if (steady && !g_settled(s, i + 1 < n ? &S[i + 1] : NULL)) steady = 0;
        if (gitems_add(out, G_SLOT, i, 0, 0) < 0) return -1;
        i += 1;
    }
    FLUSH();
#undef FLUSH
    *steady_out = steady;
    return 0;
}

/* The lone slots ``a`` and ``b`` make a call fit for a cycle (``RingEncoder._cycled``). */
static int g_cycle_fit(gsrc_t *src, const gitem_t *a, const gitem_t *b, PyObject *shown, PyObject *ok) {
    if (a->type != G_SLOT || b->type != G_SLOT) return 0;
    const slot_t *s = &src->s[a->i], *x = &src->s[b->i];
    if (s->kind != KIND_ENTER || (s->flags & 1)) return 0;
    int in = g_in(src, shown, s->ref);
    if (in <= 0) return in;
    int t = g_ok(src, ok, s->ref);
    if (t <= 0) return t;
    return x->kind == KIND_EXIT && x->call_id == s->call_id && x->ref == 0 && x->aux <= 1;
}

static int g_cycle_follows(gsrc_t *src, const slot_t *s, const slot_t *before, PyObject *lanes) {
    if (s->call_id != (uint32_t)(before->call_id + 1) || s->seq != (uint32_t)(before->seq + 1) ||
        s->step != before->step)
        return 0;
    PyObject *ka = g_ref(src, s->ref), *kb = ka == NULL ? NULL : g_ref(src, before->ref);
    if (kb == NULL) {
        Py_XDECREF(ka);
        return -1;
    }
    PyObject *a = PyDict_GetItemWithError(lanes, ka);
    PyObject *b = a == NULL && PyErr_Occurred() ? NULL : PyDict_GetItemWithError(lanes, kb);
    Py_DECREF(ka);
    Py_DECREF(kb);
    if (PyErr_Occurred()) return -1;
    if (a == NULL || b == NULL) return a == b;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* ``RingEncoder._cycles_in``: the ``m`` calls from slot ``first`` (two slots each) into ``out``. */
static int g_cycles_in(gsrc_t *src, Py_ssize_t first, Py_ssize_t m, gitems_t *out, Py_ssize_t cycle_min,
                       Py_ssize_t max_cycle) {
    unsigned long *refs = PyMem_Malloc(sizeof(unsigned long) * (size_t)(m > 0 ? m : 1));
    if (refs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < m; k++) refs[k] = src->s[first + 2 * k].ref;
    int rc = 0;
    Py_ssize_t i = 0;
    while (i < m && rc == 0) {
        Py_ssize_t best_len = 0, best_p = best_cycle(refs, i, m, cycle_min, max_cycle, &best_len);
        if (!best_p) {
            rc = gitems_add(out, G_SLOT, first + 2 * i, 0, 0) < 0 || gitems_add(out, G_SLOT, first + 2 * i + 1, 0, 0) < 0
                     ? -1
                     : 0;
            i++;
            continue;
        }
        rc = gitems_add(out, G_CYCLE, first + 2 * i, best_len, best_p);
        i += best_len;
    }
    PyMem_Free(refs);
    return rc;
}

/* ``RingEncoder._cycled``'s loop on the gathered items. */
static int g_cycles(gsrc_t *src, const gitems_t *in, PyObject *shown, PyObject *ok, PyObject *lanes,
                    Py_ssize_t cycle_min, Py_ssize_t max_cycle, gitems_t *out) {
    const gitem_t *items = in->items;
    Py_ssize_t n = in->n, i = 0;
    while (i < n) {
        Py_ssize_t j = i;
        while (j + 1 < n) {
            int fit = g_cycle_fit(src, &items[j], &items[j + 1], shown, ok);
            if (fit < 0) return -1;
            if (!fit) break;
            if (j > i) {
                int f = g_cycle_follows(src, &src->s[items[j].i], &src->s[items[j - 2].i], lanes);
                if (f < 0) return -1;
                if (!f) break;
            }
            j += 2;
        }
        if (j - i < 4 * cycle_min) {
            const gitem_t *item = &items[i];
            if (item->type == G_SLOT && src->s[item->i].kind == KIND_ENTER) {
                PyObject *key = g_ref(src, src->s[item->i].ref);
                if (key == NULL) return -1;
                int rc = PySet_Add(shown, key);
                Py_DECREF(key);
                if (rc < 0) return -1;
            }
            if (gitems_add(out, item->type, item->i, item->k, item->p) < 0) return -1;
            i++;
            continue;
        }
        if (g_cycles_in(src, items[i].i, (j - i) / 2, out, cycle_min, max_cycle) < 0) return -1;
        i = j;
    }
    return 0;
}

/* The items as Python objects: slots, runs as (enter, exit, enters, exits), cycles with their refs
 * after; NULL with an exception on failure. */
static PyObject *g_items(gsrc_t *src, const gitems_t *items) {
    PyObject *out = PyList_New(items->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < items->n; j++) {
        const gitem_t *it = &items->items[j];
        PyObject *o = NULL;
        if (it->type == G_SLOT) {
            o = g_slot(src, it->i);
            Py_XINCREF(o);
        } else {
            PyObject *enter = g_slot(src, it->i), *exit_ = enter == NULL ? NULL : g_slot(src, it->i + 1);
            PyObject *enters = PyList_New(it->k), *exits = PyList_New(it->k), *refs = NULL;
            if (exit_ == NULL || enters == NULL || exits == NULL) goto item_fail;
            for (Py_ssize_t q = 0; q < it->k; q++) {
                PyObject *a = PyFloat_FromDouble(src->s[it->i + 2 * q].time);
                PyObject *b = PyFloat_FromDouble(src->s[it->i + 2 * q + 1].time);
                PyList_SET_ITEM(enters, q, a); /* a NULL item is cleared with the list */
                PyList_SET_ITEM(exits, q, b);
                if (a == NULL || b == NULL) goto item_fail;
            }
            if (it->type == G_RUN) {
                o = PyTuple_Pack(4, enter, exit_, enters, exits);
            } else {
                refs = PyTuple_New(it->p);
                if (refs == NULL) goto item_fail;
                for (Py_ssize_t q = 0; q < it->p; q++) {
                    PyObject *r = g_ref(src, src->s[it->i + 2 * q].ref);
                    if (r == NULL) goto item_fail;
                    PyTuple_SET_ITEM(refs, q, r);
                }
                o = PyTuple_Pack(5, enter, exit_, enters, exits, refs);
            }
        item_fail:
            Py_XDECREF(enters);
            Py_XDECREF(exits);
            Py_XDECREF(refs);
        }
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, o);
    }
    return out;
}

/* gather_packed(head, data, n, whole, ok, known, run_min, slot_type, cycles) -> (items, steady):
 * ``RingEncoder._gather`` on the slots of ``head`` (a list of slot tuples: the entry held back
 * from the last batch, or a whole batch read as tuples) then the first ``n`` of ``data``
 * (``scan_packed``'s bytes), and with ``cycles`` (None, or (shown, lanes, cycle_min, max_cycle))
 * ``_cycled`` on its items; a tuple is made only for a slot that travels alone or opens a run
 * or cycle (``head``'s are handed back as they are). */
static PyObject *gather_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "gather_packed(head, data, n, whole, ok, known, run_min, slot_type, cycles)");
        return NULL;
    }
    PyObject *head = args[0], *whole = args[3], *ok = args[4], *known = args[5], *cyc = args[8];
    Py_ssize_t n = PyLong_AsSsize_t(args[2]), run_min = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred()) return NULL;
    PyObject *shown = NULL, *lanes = NULL;
    Py_ssize_t cycle_min = 0, max_cycle = 0;
    if (cyc != Py_None) {
        if (!PyArg_ParseTuple(cyc, "O!O!nn", &PySet_Type, &shown, &PyDict_Type, &lanes, &cycle_min, &max_cycle))
            return NULL;
        if (cycle_min < 1) {
            PyErr_SetString(PyExc_ValueError, "gather_packed: cycle_min < 1");
            return NULL;
        }
    }
    if (!PyList_Check(head) || !PySet_Check(whole) || !PyDict_Check(ok) || !PyType_Check(args[7]) ||
        !PyType_IsSubtype((PyTypeObject *)args[7], &PyTuple_Type) || run_min < 1) {
        PyErr_SetString(PyExc_TypeError, "gather_packed: head must be a list, whole a set, ok a dict");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return NULL;
    if (n < 0 || n > view.len / (Py_ssize_t)sizeof(slot_t)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "gather_packed: n is past the data's end");
        return NULL;
    }
    Py_ssize_t h = PyList_GET_SIZE(head), m = h + n;
    gsrc_t src = {0};
    gitems_t gathered = {0}, cycled = {0};
    PyObject *items = NULL;
    int steady = 0;
    src.n = m;
    src.slot_type = (PyTypeObject *)args[7];
    src.s = PyMem_Malloc(sizeof(slot_t) * (size_t)(m > 0 ? m : 1));
    src.obj = PyMem_Calloc((size_t)(m > 0 ? m : 1), sizeof(PyObject *));
    if (src.s == NULL || src.obj == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < h; j++) { /* the list may change under ``known``: taken now */
        PyObject *t = PyList_GET_ITEM(head, j);
        if (g_from_tuple(t, &src.s[j]) < 0) goto done;
        src.obj[j] = Py_NewRef(t);
    }
    if (n > 0) memcpy(src.s + h, view.buf, sizeof(slot_t) * (size_t)n);
    PyBuffer_Release(&view);
    view.obj = NULL;
    if (g_gather(&src, whole, ok, known, run_min, &gathered, &steady) < 0) goto done;
    if (shown != NULL) {
        if (g_cycles(&src, &gathered, shown, ok, lanes, cycle_min, max_cycle, &cycled) < 0) goto done;
        items = g_items(&src, &cycled);
    } else {
        items = g_items(&src, &gathered);
    }
done:
    if (view.obj != NULL) PyBuffer_Release(&view);
    if (src.obj != NULL)
        for (Py_ssize_t j = 0; j < m; j++) Py_XDECREF(src.obj[j]);
    for (int j = 0; j < src.refs; j++) Py_DECREF(src.ref_obj[j]);
    PyMem_Free(src.obj);
    PyMem_Free(src.s);
    PyMem_Free(gathered.items);
    PyMem_Free(cycled.items);
    if (items == NULL) return NULL;
    return Py_BuildValue("(NO)", items, steady ? Py_True : Py_False);
}

/* general_enter(tls): the calling thread enters a call the Python wrapper records: ``tls.depth``
 * set and the count of such threads up, in one step (no Python code between them, so no signal
 * handler's exception leaves one done without the other). */
static PyObject *general_enter(PyObject *module, PyObject *tls) {
    if (PyObject_SetAttr(tls, s_depth, s_one) < 0) return NULL;
    general_inside++;
    Py_RETURN_NONE;
}

/* general_leave(tls): the calling thread left it (once: a second call does nothing). */
static PyObject *general_leave(PyObject *module, PyObject *tls) {
    int inside = truthy_attr(tls, s_depth);
    if (inside < 0) return NULL;
    if (!inside) Py_RETURN_NONE;
    if (PyObject_SetAttr(tls, s_depth, s_zero) < 0) return NULL;
    if (general_inside > 0) general_inside--;
    Py_RETURN_NONE;
}

static int ll_args(PyObject *const *args, Py_ssize_t from, Py_ssize_t n, unsigned long long *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsUnsignedLongLongMask(args[from + i]);
        if (out[i] == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* put_slot(mm, positions, capacity, kind, flags, aux, ref, call_id, seq, step, arg, time) -> position:
 * the Python writers' way into the ring (``RingWriter.put``): the slot claimed from ``positions``
 * and published in one step, as the fast path here does. Integers are kept to their fields' widths. */
static PyObject *put_slot_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "put_slot(mm, positions, capacity, kind, flags, aux, ref, call_id, seq, step, arg, time)");
        return NULL;
    }
    long long capacity = PyLong_AsLongLong(args[2]), h = 0;
    unsigned long long v[8];
    if ((capacity == -1 && PyErr_Occurred()) || ll_args(args, 3, 8, v) < 0) return NULL;
    double t = PyFloat_AsDouble(args[11]);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    slot_t slot = {0};
    slot.kind = (uint8_t)v[0];
    slot.flags = (uint8_t)v[1];
    slot.aux = (uint16_t)v[2];
    slot.ref = (uint32_t)v[3];
    slot.call_id = (uint32_t)v[4];
    slot.seq = (uint32_t)v[5];
    slot.step = (uint32_t)v[6];
    slot.arg = (uint32_t)v[7];
    slot.time = t;
    if (claim_slot(args[0], args[1], RING_HEADER, capacity, &slot, &h) < 0) return NULL;
    return PyLong_FromLongLong(h);
}

/* A u64 word of the ring's header (8-byte aligned, inside the mapping): its address. */
static uint64_t *header_word(Py_buffer *view, PyObject *offset_obj) {
    Py_ssize_t offset = PyLong_AsSsize_t(offset_obj);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    char *at = (char *)view->buf + offset;
    if (offset < 0 || offset + 8 > view->len || ((uintptr_t)at & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "not an aligned word of the ring");
        return NULL;
    }
    return (uint64_t *)(void *)at;
}

#define WORD_OP(name, writable, body)                                                   \
    static PyObject *name(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {  \
        if (nargs != 2 + (writable)) {                                                  \
            PyErr_SetString(PyExc_TypeError, #name ": wrong number of arguments");     \
            return NULL;                                                                \
        }                                                                               \
        Py_buffer view;                                                                 \
        if (PyObject_GetBuffer(args[0], &view, (writable) ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) \
            return NULL;                                                                \
        uint64_t *word = header_word(&view, args[1]);                                   \
        PyObject *out = NULL;                                                           \
        if (word != NULL) {                                                             \
            body                                                                        \
        }                                                                               \
        PyBuffer_Release(&view);                                                        \
        return out;                                                                     \
    }

/* store_release(mm, offset, value): publishes what was written before (a blob under blob_used,
 * a status under its even sequence). */
WORD_OP(store_release, 1, {
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[2]);
    if (!(value == (unsigned long long)-1 && PyErr_Occurred())) {
        __atomic_store_n(word, (uint64_t)value, __ATOMIC_RELEASE);
        out = Py_NewRef(Py_None);
    }
})

/* store_begin(mm, offset, value): the store, then a release fence: what is written after it
 * (a status's text under its odd sequence) is seen only with it. */
WORD_OP(store_begin, 1, {
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[2]);
    if (!(value == (unsigned long long)-1 && PyErr_Occurred())) {
        __atomic_store_n(word, (uint64_t)value, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        out = Py_NewRef(Py_None);
    }
})

/* load_acquire(mm, offset) -> value: what it covers may be read after it. */
WORD_OP(load_acquire, 0, { out = PyLong_FromUnsignedLongLong(__atomic_load_n(word, __ATOMIC_ACQUIRE)); })

/* load_after(mm, offset) -> value: an acquire fence, then the load (a status's sequence again,
 * after its text was copied). */
WORD_OP(load_after, 0, {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    out = PyLong_FromUnsignedLongLong(__atomic_load_n(word, __ATOMIC_RELAXED));
})

/* Tests: the reader's steps interleaved by hand with a writer's. ``between(step)`` is called
 * between the reader's protocol steps; what it raises is raised when the reader is done. */
typedef struct {
    PyObject *fn;
    int failed;
} stepper_t;

static void call_between(void *arg, int step) {
    stepper_t *st = arg;
    if (st->failed) return;
    PyObject *r = PyObject_CallFunction(st->fn, "i", step);
    if (r == NULL) st->failed = 1;
    Py_XDECREF(r);
}

/* _take_steps(mm, capacity, position, between) -> (whole, slot_bytes): the slot at ``position``
 * as ``scan_packed`` takes it, ``between`` between its steps. */
static PyObject *take_steps(PyObject *module, PyObject *args) {
    PyObject *mm, *fn;
    long long capacity, p;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OLLO", &mm, &capacity, &p, &fn)) return NULL;
    if (p < 0) {
        PyErr_SetString(PyExc_ValueError, "_take_steps: bad position");
        return NULL;
    }
    if (PyObject_GetBuffer(mm, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *base = ring_slots(&view, RING_HEADER, capacity);
    stepper_t st = {fn, 0};
    slot_t slot;
    int whole = 0;
    if (base != NULL)
        whole = slot_take(base + (Py_ssize_t)(p % capacity) * (Py_ssize_t)sizeof(slot_t), (uint64_t)p + 1, &slot,
                          call_between, &st);
    PyBuffer_Release(&view);
    if (base == NULL || st.failed) return NULL;
    return Py_BuildValue("(Ny#)", PyBool_FromLong(whole), (const char *)&slot, (Py_ssize_t)sizeof slot);
}

static PyObject *fence_acquire(PyObject *module, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    Py_RETURN_NONE;
}

/* put_blob(mm, blobs_at, limit, data) -> id: ``data`` appended to the ring's blob area (which
 * begins at ``blobs_at``; it may fill up to ``limit`` bytes) and published: its bytes, then the
 * blob count, then ``blob_used`` by a store-release. 0 where there is no room (counted in
 * ``blobs_dropped``). One step under the GIL: safe from any thread, and no signal handler runs
 * inside it. */
static PyObject *put_blob(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put_blob(mm, blobs_at, limit, data)");
        return NULL;
    }
    Py_ssize_t blobs_at = PyLong_AsSsize_t(args[1]), limit = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view, data;
    if (PyObject_GetBuffer(args[3], &data, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    PyObject *out = NULL;
    if (blobs_at < RING_HEADER || limit < 0 || blobs_at > view.len - limit || data.len > UINT32_MAX ||
        ((uintptr_t)view.buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "put_blob: the blob area is outside the mapping");
        goto done;
    }
    uint64_t *used_w = (uint64_t *)(void *)((char *)view.buf + BLOB_USED_AT);
    uint64_t *dropped_w = used_w + 1, *count_w = used_w + 2;
    uint64_t used = __atomic_load_n(used_w, __ATOMIC_RELAXED), count = __atomic_load_n(count_w, __ATOMIC_RELAXED);
    uint64_t need = 8 + (uint64_t)data.len;
    if (used > (uint64_t)limit || need > (uint64_t)limit - used) {
        __atomic_store_n(dropped_w, __atomic_load_n(dropped_w, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
        out = PyLong_FromLong(0);
        goto done;
    }
    char *at = (char *)view.buf + blobs_at + used;
    uint32_t head[2] = {(uint32_t)(count + 1), (uint32_t)data.len};
    memcpy(at, head, sizeof head);
    memcpy(at + sizeof head, data.buf, (size_t)data.len);
    __atomic_store_n(count_w, count + 1, __ATOMIC_RELAXED);
    __atomic_store_n(used_w, used + need, __ATOMIC_RELEASE); /* published last */
    out = PyLong_FromUnsignedLongLong(count + 1);
done:
    PyBuffer_Release(&view);
    PyBuffer_Release(&data);
    return out;
}

static PyObject *set_foreign(PyObject *module, PyObject *fn) {
    Py_XSETREF(foreign_fn, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyObject *general_count(PyObject *module, PyObject *unused) {
    return PyLong_FromSsize_t(general_inside);
}

static PyMethodDef module_methods[] = {
    {"general_enter", general_enter, METH_O, "The calling thread enters a call the Python wrapper records."},
    {"general_leave", general_leave, METH_O, "The calling thread left a call the Python wrapper records."},
    {"put_slot", (PyCFunction)(void (*)(void))put_slot_py, METH_FASTCALL,
     "put_slot(mm, positions, capacity, kind, flags, aux, ref, call_id, seq, step, arg, time) -> position."},
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL, "store_release(mm, offset, value)."},
    {"store_begin", (PyCFunction)(void (*)(void))store_begin, METH_FASTCALL, "store_begin(mm, offset, value)."},
    {"load_acquire", (PyCFunction)(void (*)(void))load_acquire, METH_FASTCALL, "load_acquire(mm, offset) -> value."},
    {"load_after", (PyCFunction)(void (*)(void))load_after, METH_FASTCALL, "load_after(mm, offset) -> value."},
    {"fence_acquire", fence_acquire, METH_NOARGS, "An acquire fence (between a reader's copies)."},
    {"put_blob", (PyCFunction)(void (*)(void))put_blob, METH_FASTCALL, "put_blob(mm, blobs_at, limit, data) -> id."},
    {"_take_steps", take_steps, METH_VARARGS, "Tests: a slot taken step by step."},
    {"set_foreign", set_foreign, METH_O, "The function that tells the program's exceptions from the hook's."},
    {"general_inside", general_count, METH_NOARGS, "Threads inside a call the Python wrapper records."},
    {"scan_packed", (PyCFunction)(void (*)(void))scan_packed, METH_FASTCALL,
     "scan_packed(mm, header, capacity, position, budget) -> (data, position, stopped)."},
    {"gather_packed", (PyCFunction)(void (*)(void))gather_packed, METH_FASTCALL,
     "gather_packed(head, data, n, whole, ok, known, run_min, slot_type, cycles) -> (items, steady)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_fastpath",
    .m_doc = "The hook's fast path in C (see _fastpath.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

#define INTERN(var, text)                                   \
    do {                                                    \
        if ((var = PyUnicode_InternFromString(text)) == NULL) \
            return NULL;                                    \
    } while (0)

PyMODINIT_FUNC PyInit__fastpath(void) {
#ifdef Py_GIL_DISABLED
    /* everything here relies on the GIL: refused, rather than turn it back on for the process */
    PyErr_SetString(PyExc_ImportError, "hangwatch's C fast path relies on the GIL: not on a free-threaded interpreter");
    return NULL;
#endif
    INTERN(s_active, "_active");
    INTERN(s_depth, "depth");
    INTERN(s_recorder, "recorder");
    INTERN(s_memo, "memo");
    INTERN(s_covers, "covers");
    INTERN(s_sink, "sink");
    INTERN(s_mm, "mm");
    INTERN(s_positions, "positions");
    INTERN(s_capacity, "capacity");
    INTERN(s_groups, "groups");
    INTERN(s_p2p_ops, "p2p_ops");
    INTERN(s_ids, "_ids");
    INTERN(s_step, "step");
    INTERN(s_shape, "shape");
    INTERN(s_dtype, "dtype");
    INTERN(s_is_cuda, "is_cuda");
    if (s_zero == NULL && (s_zero = PyLong_FromLong(0)) == NULL) return NULL;
    if (s_one == NULL && (s_one = PyLong_FromLong(1)) == NULL) return NULL;
    if (PyType_Ready(&FastOpType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FastOpType);
    if (PyModule_AddObject(m, "FastOp", (PyObject *)&FastOpType) < 0) {
        Py_DECREF(&FastOpType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "SLOT_SIZE", (long)sizeof(slot_t)) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", RING_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "BLOB_USED_OFFSET", BLOB_USED_AT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
