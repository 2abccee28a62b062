/* Fused copy + sum64 checksum for snapshot chunks: one pass over the bytes instead of two.
 *
 * copy_sum64(dst, src, nbytes) copies nbytes from address src to address dst and returns the sum,
 * modulo 2**64, of the copied bytes read as native-endian 64-bit words, the last partial word
 * zero-extended: the "sum64" checksum of checksum.py over the destination when the bytes after
 * it up to the next 8-byte boundary are zero (the chunk layout's padding is).
 *
 * Large copies into 16-byte aligned destinations use SSE2 non-temporal stores: a snapshot is not
 * read back soon, so its lines need not displace the training's data from the caches, and a
 * streaming store skips the read-for-ownership of the destination (a third of the memory traffic
 * of a plain copy). The GIL is released for the copy, so that the runtime's receive-waiter thread
 * can note that a message arrived while a chunk is being copied.
 *
 * Optional: built when a C compiler is present (see pyproject.toml); layout.py falls back to
 * NumPy copies and a separate checksum pass without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

/* Source lines are prefetched this far ahead with the non-temporal hint. Measured on the dev VM
 * (AMD EPYC, KVM; a scratch run, twice): a training process on the other core, computing while
 * this one copies, as a stage does in its neighbour's bubble, slowed by 0.57-0.58% per GB/s
 * copied with the prefetch against 0.74-0.91% without it, and the copy ran 11-14% faster.
 * A prefetch past the end of the source does not fault. */
#define PREFETCH_AHEAD 1024

/* Below this, plain stores: streaming a few lines is not worth the fence. */
#define STREAM_MIN_BYTES (64 * 1024)

static uint64_t copy_sum64_impl(char *dst, const char *src, size_t n) {
    uint64_t sum = 0;
    size_t i = 0;
#if defined(__SSE2__)
    if (n >= STREAM_MIN_BYTES && ((uintptr_t)dst & 15) == 0) {
        __m128i acc0 = _mm_setzero_si128(), acc1 = _mm_setzero_si128();
        __m128i acc2 = _mm_setzero_si128(), acc3 = _mm_setzero_si128();
        for (; i + 64 <= n; i += 64) {
            _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_NTA);
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
            acc0 = _mm_add_epi64(acc0, a);
            acc1 = _mm_add_epi64(acc1, b);
            acc2 = _mm_add_epi64(acc2, c);
            acc3 = _mm_add_epi64(acc3, d);
        }
        _mm_sfence(); /* the streamed lines are visible before the record that names them */
        uint64_t lanes[2];
        _mm_storeu_si128((__m128i *)lanes,
                         _mm_add_epi64(_mm_add_epi64(acc0, acc1), _mm_add_epi64(acc2, acc3)));
        sum = lanes[0] + lanes[1];
    }
#endif
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, src + i, 8);
        memcpy(dst + i, &v, 8);
        sum += v;
    }
    if (i < n) {
        uint64_t tail = 0;
        memcpy(&tail, src + i, n - i);
        memcpy(dst + i, &tail, n - i);
        sum += tail;
    }
    return sum;
}

/* The calling thread's scheduling policy (Linux: pid 0 is the calling thread). */
static void set_policy(int policy) {
    struct sched_param param;
    memset(&param, 0, sizeof param);
    (void)sched_setscheduler(0, policy, &param);
}

/* Copy in pieces of `piece_bytes` (a multiple of 64) and, after each piece but the last, act on
 * the int at `flag`, which the runtime sets while the training thread sleeps in a receive and
 * this copy fills its bubble:
 *   1 (YIELD): give up the CPU (sched_yield), so that the training thread, woken on this core
 *     when the data lands, runs after at most one piece instead of when the scheduler next
 *     looks (up to a tick, 4 ms on the dev VM);
 *   2 (ENTER_KERNEL; only where the process may restore a thread's priority): copy at
 *     SCHED_IDLE, which any waking normal thread preempts, and between pieces only enter the
 *     kernel (getppid): this kernel applies a preemption lazily, at the current thread's next
 *     return from the kernel or at the next tick, and a sched_yield would hand the core to any
 *     other runnable idle task (a persist helper) for a whole time slice per piece. The thread
 *     is at SCHED_IDLE only here, with the GIL released: a thread that held the GIL at idle
 *     priority could be starved by other work while the woken training thread waits for the
 *     GIL (seen: a 1.4 s stall beside a starting persist helper). The runtime restores normal
 *     priority when it clears the flag (and then waits for this chunk), so the copy re-checks
 *     the flag after lowering its priority: a clear that came in between is not undone.
 *   0: nothing. Once the training thread has the core back it clears the flag, and the rest of
 * the chunk it waits for is copied straight through. The sum is the same as one pass: every
 * piece but the last is a whole number of words. */
static uint64_t copy_sum64_pieces(char *dst, const char *src, size_t n, size_t piece_bytes,
                                  const volatile int *flag) {
    if (piece_bytes == 0 || flag == NULL || n <= piece_bytes) return copy_sum64_impl(dst, src, n);
    int idle = 0;
    if (*flag == 2) {
        set_policy(SCHED_IDLE);
        idle = 1;
        if (*flag != 2) {  /* paused meanwhile: its restore may have come first */
            set_policy(SCHED_OTHER);
            idle = 0;
        }
    }
    uint64_t sum = 0;
    size_t i = 0;
    for (; i + piece_bytes < n; i += piece_bytes) {
        sum += copy_sum64_impl(dst + i, src + i, piece_bytes);
        int mode = *flag;
        if (mode == 1) {
            sched_yield();
        } else if (mode == 2) {
            (void)getppid();
        }
    }
    sum += copy_sum64_impl(dst + i, src + i, n - i);
    if (idle) set_policy(SCHED_OTHER);
    return sum;
}

static PyObject *copy_sum64(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy_sum64(dst_address, src_address, num_bytes"
                                         "[, piece_bytes, yield_flag_address])");
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    void *src = PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "num_bytes must be >= 0");
        return NULL;
    }
    if (n > 0 && (dst == NULL || src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "null address");
        return NULL;
    }
    Py_ssize_t piece_bytes = 0;
    const volatile int *flag = NULL;
    if (nargs == 5) {
        piece_bytes = PyLong_AsSsize_t(args[3]);
        if (piece_bytes == -1 && PyErr_Occurred()) return NULL;
        if (piece_bytes < 0 || piece_bytes % 64) {
            PyErr_SetString(PyExc_ValueError, "piece_bytes must be a multiple of 64, >= 0");
            return NULL;
        }
        flag = (const volatile int *)PyLong_AsVoidPtr(args[4]);
        if (flag == NULL && PyErr_Occurred()) return NULL;
    }
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    sum = copy_sum64_pieces((char *)dst, (const char *)src, (size_t)n, (size_t)piece_bytes, flag);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong((unsigned long long)sum);
}

static PyMethodDef methods[] = {
    {"copy_sum64", (PyCFunction)(void (*)(void))copy_sum64, METH_FASTCALL,
     "copy_sum64(dst_address, src_address, num_bytes[, piece_bytes, yield_flag_address])"
     " -> int\n\n"
     "Copy num_bytes from src to dst; return their sum64 checksum. With piece_bytes > 0, between\n"
     "pieces yield the CPU while the C int at yield_flag_address is 1, enter the kernel while\n"
     "it is 2 (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_copysum",
    "Fused copy + sum64 checksum of snapshot chunks (see layout.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__copysum(void) { return PyModule_Create(&module_def); }
