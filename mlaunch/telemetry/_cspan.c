/* The flight recorder's recorded span on the training thread, in C.

   ``SpanBase`` holds a recorded span's fields and does exactly what the pure-Python
   ``_PySpanBase.__enter__``/``__exit__`` in ``_recorder.py`` do (that code is the definition;
   this mirrors it line by line), without the two Python frames and the ``time_ns()`` calls.

   Everything it reads that Python may rebind (the thread-local, the state object, the current
   iteration's list, the helpers) it reads from the ``_recorder`` module's globals on every call,
   as the Python code does: ``bind(globals())`` hands it that dict once. A span that ends with an
   exception calls back into Python (``self._record_error``) for the rare part. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

#ifdef Py_GIL_DISABLED
/* The caches below rely on the GIL; a free-threaded build falls back to the Python classes. */
#error "mlaunch.telemetry._cspan needs a CPython with the GIL"
#endif

enum { UNSET, NS, OBJECT };
typedef struct {
    int kind;
    long long ns;
    PyObject *obj; /* kind OBJECT */
} Times;

enum { START, END };
static const char *const time_names[2] = {"start", "end"};

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *attributes;
    PyObject *events;
    PyObject *status;
    PyObject *parent;
    PyObject *span_id;
    PyObject *stack;
    /* start and end: the clock's int64 ns as __enter__/__exit__ read it (an int object is made
       only when something reads it, in practice a dump), or whatever Python stored there. */
    Times times[2];
} SpanBase;

/* The _recorder module's globals (set by bind()), and the names the hot path reads there. */
static PyObject *g_globals = NULL;
enum { G_TLS, G_NEW_STACK, G_STATE, G_CURRENT, G_POP, G_COUNT };
static const char *const g_names[G_COUNT] = {"_tls", "_new_stack", "_STATE", "_CURRENT", "_pop"};
static PyObject *g_keys[G_COUNT];
/* Their values, borrowed from g_globals: valid while that dict has not changed since they were
   read (a dict lookup per name and call costs more than the rest of __enter__). */
static PyObject *g_values[G_COUNT];
static int g_valid = 0;
#if PY_VERSION_HEX < 0x030C0000
/* 3.11: the dict's version tag changes with every change to it. */
static uint64_t g_tag;
#define VALUES_VALID() (g_valid && ((PyDictObject *)g_globals)->ma_version_tag == g_tag)
#define VALUES_READ() (g_tag = ((PyDictObject *)g_globals)->ma_version_tag)
#else
/* 3.12+: a dict watcher says when it changes. */
static int g_watcher = -1;
#define VALUES_VALID() (g_valid)
#define VALUES_READ() ((void)0)

static int
globals_changed(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *value)
{
    (void)event, (void)key, (void)value;
    if (dict == g_globals) {
        g_valid = 0;
    }
    return 0;
}
#endif
static PyObject *s_stack, *s_trace_id, *s_record_error;

/* This thread's span stack, as ``_tls.stack`` gave it, and the ``_tls`` it came from (strong
   references: a rebound ``_tls`` is never mistaken for this one). ``_new_stack`` binds a thread's
   ``_tls.stack`` once, when the thread first opens a span, and nothing rebinds it. */
static __thread PyObject *t_tls = NULL;
static __thread PyObject *t_stack = NULL;

/* time.time_ns()'s clock; -1 with OSError set on failure. */
static long long
now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return (long long)ts.tv_sec * 1000000000LL + (long long)ts.tv_nsec;
}

static void
set_ns(Times *t, long long ns)
{
    Py_CLEAR(t->obj);
    t->kind = NS;
    t->ns = ns;
}

/* The start/end attribute: as a slot would behave (AttributeError while unset). */
static PyObject *
time_get(SpanBase *self, void *which)
{
    Times *t = &self->times[(intptr_t)which];
    switch (t->kind) {
    case NS:
        return PyLong_FromLongLong(t->ns);
    case OBJECT:
        return Py_NewRef(t->obj);
    default:
        PyErr_SetString(PyExc_AttributeError, time_names[(intptr_t)which]);
        return NULL;
    }
}

static int
time_set(SpanBase *self, PyObject *value, void *which)
{
    Times *t = &self->times[(intptr_t)which];
    if (value == NULL) { /* del */
        if (t->kind == UNSET) {
            PyErr_SetString(PyExc_AttributeError, time_names[(intptr_t)which]);
            return -1;
        }
        Py_CLEAR(t->obj);
        t->kind = UNSET;
        return 0;
    }
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long ns = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (!overflow && !(ns == -1 && PyErr_Occurred())) {
            set_ns(t, ns);
            return 0;
        }
        PyErr_Clear();
    }
    Py_XSETREF(t->obj, Py_NewRef(value)); /* any other object, kept as it is */
    t->kind = OBJECT;
    return 0;
}

/* A global of _recorder (borrowed; incref it before calling into Python), or NULL with
   NameError set. */
static PyObject *
global(int i)
{
    if (g_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mlaunch.telemetry._cspan: bind() was not called");
        return NULL;
    }
    if (VALUES_VALID()) {
        return g_values[i];
    }
    int complete = 1;
    for (int k = 0; k < G_COUNT; k++) {
        g_values[k] = PyDict_GetItemWithError(g_globals, g_keys[k]);
        if (g_values[k] == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            complete = 0;
        }
    }
    if (g_values[i] == NULL) {
        PyErr_Format(PyExc_NameError, "name '%U' is not defined", g_keys[i]);
        return NULL;
    }
    if (complete) { /* else looked up again next time */
        VALUES_READ();
        g_valid = 1;
    }
    return g_values[i];
}

static int
append(PyObject *list, PyObject *item)
{
    if (PyList_CheckExact(list)) {
        return PyList_Append(list, item);
    }
    PyObject *r = PyObject_CallMethod(list, "append", "O", item);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *
enter(SpanBase *self, int root)
{
    PyObject *tls = global(G_TLS);
    if (tls == NULL) {
        return NULL;
    }
    PyObject *stack;
    if (tls == t_tls) {
        stack = Py_NewRef(t_stack);
    }
    else {
        Py_INCREF(tls);
        stack = PyObject_GetAttr(tls, s_stack);
        if (stack == NULL) {
            PyObject *new_stack;
            if (!PyErr_ExceptionMatches(PyExc_AttributeError) ||
                (PyErr_Clear(), (new_stack = global(G_NEW_STACK)) == NULL)) {
                Py_DECREF(tls);
                return NULL;
            }
            Py_INCREF(new_stack);
            stack = PyObject_CallNoArgs(new_stack);
            Py_DECREF(new_stack);
            if (stack == NULL) {
                Py_DECREF(tls);
                return NULL;
            }
        }
        Py_XSETREF(t_tls, tls); /* takes the reference */
        Py_XSETREF(t_stack, Py_NewRef(stack));
    }
    Py_XSETREF(self->stack, stack); /* steals the reference */
    PyObject *parent = NULL;
    if (!root) {
        /* stack[-1] if stack else _STATE.trace_id */
        int nonempty = PyList_CheckExact(stack) ? PyList_GET_SIZE(stack) > 0
                                                 : PyObject_IsTrue(stack);
        if (nonempty < 0) {
            return NULL;
        }
        if (nonempty) {
            parent = PyList_CheckExact(stack)
                         ? Py_NewRef(PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1))
                         : PySequence_GetItem(stack, -1);
            if (parent == NULL) {
                return NULL;
            }
        }
    }
    if (parent == NULL) {
        PyObject *state = global(G_STATE);
        if (state == NULL) {
            return NULL;
        }
        Py_INCREF(state);
        parent = PyObject_GetAttr(state, s_trace_id);
        Py_DECREF(state);
        if (parent == NULL) {
            return NULL;
        }
    }
    Py_XSETREF(self->parent, parent);
    if (append(stack, (PyObject *)self) < 0) {
        return NULL;
    }
    long long start = now_ns();
    if (start == -1) {
        return NULL;
    }
    set_ns(&self->times[START], start);
    return Py_NewRef((PyObject *)self);
}

static PyObject *
span_enter(SpanBase *self, PyObject *Py_UNUSED(ignored))
{
    return enter(self, 0);
}

static PyObject *
span_enter_root(SpanBase *self, PyObject *Py_UNUSED(ignored))
{
    return enter(self, 1);
}

/* stack.pop() for a list (IndexError when empty), else the method. */
static PyObject *
pop_last(PyObject *stack)
{
    if (!PyList_CheckExact(stack)) {
        return PyObject_CallMethod(stack, "pop", NULL);
    }
    Py_ssize_t n = PyList_GET_SIZE(stack);
    if (n == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from empty list");
        return NULL;
    }
    /* What list.pop() does when it keeps its allocation: the list's reference becomes ours. */
    PyObject *top = PyList_GET_ITEM(stack, n - 1);
    Py_SET_SIZE(stack, n - 1);
    return top;
}

static PyObject *
span_exit(SpanBase *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__ expected 3 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *exc = args[1];
    long long end = now_ns();
    if (end == -1) {
        return NULL;
    }
    PyObject *stack = self->stack;
    if (stack == NULL) {
        PyErr_SetString(PyExc_AttributeError, "stack");
        return NULL;
    }
    if (stack == Py_None) { /* already ended by shutdown (truncated) */
        Py_RETURN_NONE;
    }
    Py_INCREF(stack); /* held across calls back into Python, which may rebind self.stack */
    set_ns(&self->times[END], end);
    /* Pop first and look after: one call when spans end innermost first, as they do. */
    PyObject *top = pop_last(stack);
    if (top == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) {
            goto fail;
        }
        PyErr_Clear(); /* the stack was cleared under it */
        top = Py_NewRef((PyObject *)self);
    }
    if (top != (PyObject *)self) { /* ended out of order (generators, threads) */
        PyObject *pop = NULL, *r = NULL;
        if (append(stack, top) == 0 && (pop = global(G_POP)) != NULL) {
            Py_INCREF(pop);
            r = PyObject_CallFunctionObjArgs(pop, stack, (PyObject *)self, NULL);
            Py_DECREF(pop);
        }
        Py_DECREF(top);
        if (r == NULL) {
            goto fail;
        }
        Py_DECREF(r);
    }
    else {
        Py_DECREF(top);
    }
    if (exc != Py_None) {
        PyObject *end_obj = PyLong_FromLongLong(end), *r = NULL;
        if (end_obj != NULL) {
            r = PyObject_CallMethodObjArgs((PyObject *)self, s_record_error, exc, end_obj, NULL);
            Py_DECREF(end_obj);
        }
        if (r == NULL) {
            goto fail;
        }
        Py_DECREF(r);
    }
    PyObject *current = global(G_CURRENT);
    if (current == NULL || append(current, (PyObject *)self) < 0) {
        goto fail;
    }
    Py_DECREF(stack);
    Py_RETURN_NONE; /* falsy: the exception, if any, propagates */
fail:
    Py_DECREF(stack);
    return NULL;
}

static int
span_traverse(SpanBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->attributes);
    Py_VISIT(self->events);
    Py_VISIT(self->status);
    Py_VISIT(self->parent);
    Py_VISIT(self->span_id);
    Py_VISIT(self->stack);
    Py_VISIT(self->times[START].obj);
    Py_VISIT(self->times[END].obj);
    return 0;
}

static int
span_clear(SpanBase *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->attributes);
    Py_CLEAR(self->events);
    Py_CLEAR(self->status);
    Py_CLEAR(self->parent);
    Py_CLEAR(self->span_id);
    Py_CLEAR(self->stack);
    Py_CLEAR(self->times[START].obj);
    Py_CLEAR(self->times[END].obj);
    return 0;
}

static void
span_dealloc(SpanBase *self)
{
    PyObject_GC_UnTrack(self);
    span_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* With span_times, the same names as _PySpanBase.__slots__ (a test compares them). */
static PyMemberDef span_members[] = {
    {"name", T_OBJECT_EX, offsetof(SpanBase, name), 0, NULL},
    {"attributes", T_OBJECT_EX, offsetof(SpanBase, attributes), 0, NULL},
    {"events", T_OBJECT_EX, offsetof(SpanBase, events), 0, NULL},
    {"status", T_OBJECT_EX, offsetof(SpanBase, status), 0, NULL},
    {"parent", T_OBJECT_EX, offsetof(SpanBase, parent), 0, NULL},
    {"_span_id", T_OBJECT_EX, offsetof(SpanBase, span_id), 0, NULL},
    {"stack", T_OBJECT_EX, offsetof(SpanBase, stack), 0, NULL},
    {NULL},
};

static PyGetSetDef span_times[] = {
    {"start", (getter)time_get, (setter)time_set, NULL, (void *)START},
    {"end", (getter)time_get, (setter)time_set, NULL, (void *)END},
    {NULL},
};

static PyMethodDef span_methods[] = {
    {"__enter__", (PyCFunction)span_enter, METH_NOARGS, NULL},
    {"_enter_root", (PyCFunction)span_enter_root, METH_NOARGS,
     "__enter__ of a root span: the parent is the trace id whatever is open."},
    {"__exit__", (PyCFunction)(void (*)(void))span_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyTypeObject SpanBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mlaunch.telemetry._cspan.SpanBase",
    .tp_doc = "A recorded span's fields and its __enter__/__exit__ (see _recorder.py).",
    .tp_basicsize = sizeof(SpanBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_traverse = (traverseproc)span_traverse,
    .tp_clear = (inquiry)span_clear,
    .tp_members = span_members,
    .tp_getset = span_times,
    .tp_methods = span_methods,
};

static PyObject *
bind(PyObject *Py_UNUSED(module), PyObject *globals)
{
    if (!PyDict_Check(globals)) {
        PyErr_SetString(PyExc_TypeError, "bind() takes the _recorder module's globals()");
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (g_globals != NULL && PyDict_Unwatch(g_watcher, g_globals) < 0) {
        return NULL;
    }
    if (PyDict_Watch(g_watcher, globals) < 0) {
        return NULL;
    }
#endif
    g_valid = 0;
    Py_XSETREF(g_globals, Py_NewRef(globals));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_O, "Read the hot path's globals from this dict (the _recorder module's)."},
    {NULL},
};

static struct PyModuleDef cspan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mlaunch.telemetry._cspan",
    .m_doc = "The flight recorder's recorded span in C (optional; _recorder.py falls back).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__cspan(void)
{
    for (int k = 0; k < G_COUNT; k++) {
        if (g_keys[k] == NULL && (g_keys[k] = PyUnicode_InternFromString(g_names[k])) == NULL) {
            return NULL;
        }
    }
    if ((s_stack = PyUnicode_InternFromString("stack")) == NULL ||
        (s_trace_id = PyUnicode_InternFromString("trace_id")) == NULL ||
        (s_record_error = PyUnicode_InternFromString("_record_error")) == NULL) {
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (g_watcher < 0 && (g_watcher = PyDict_AddWatcher(globals_changed)) < 0) {
        return NULL;
    }
#endif
    if (PyType_Ready(&SpanBaseType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&cspan_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "SpanBase", (PyObject *)&SpanBaseType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
