/* extsrc.shm._stream: copy a large sample into shared memory with non-temporal stores.
 *
 * A slot's memory is written once per lap through the slots and read by another process
 * much later, so caching it only costs a read of every destination line before it is
 * overwritten (the "read for ownership"). Streaming stores write past the caches and skip
 * that read. glibc's memcpy switches to them only above a threshold derived from the cache
 * sizes it sees (hundreds of MiB on some virtual machines), so the worker does it here.
 *
 * copy(destination, source): both C-contiguous buffers of the same byte length; the
 * destination writable. The GIL is released during the copy. Other architectures than
 * x86-64 use memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define EXTSRC_STREAMING 1
#else
#define EXTSRC_STREAMING 0
#endif

#define LINE 64

static void stream_copy(char *dst, const char *src, size_t n)
{
#if EXTSRC_STREAMING
    size_t head = (LINE - ((uintptr_t)dst % LINE)) % LINE;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t lines = n / LINE;
    for (size_t i = 0; i < lines; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += LINE;
        src += LINE;
    }
    memcpy(dst, src, n % LINE);
    /* Streaming stores are weakly ordered: make them visible before the worker says the
       sample is written (the message that follows is the reader's only signal). */
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "copy() needs C-contiguous buffers");
        goto fail;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy(): the destination has %zd bytes, the source %zd",
                     dst.len, src.len);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(destination, source): the source's bytes into the destination, past the caches."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "extsrc.shm._stream",
    "Copies into shared memory with non-temporal stores (see the C source).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stream(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", EXTSRC_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
