"""One BLAS thread for each media thread.

The image resizes are BLAS products (runtime/image_transform.py) run in many media and frame threads at once.
OpenBLAS, as numpy bundles it, would also split each product over every core: with several threads calling it, its
workers wait on one another, and the seeds' video frames resized 1.5 to 5 times slower (two cores, small products).
So each media thread asks for products on its own thread only, with OpenBLAS's thread-local setting (0.3.27 and
later); other threads, and other BLAS libraries, keep their settings.
"""

from __future__ import annotations

import ctypes

SETTER = "openblas_set_num_threads_local"


def _openblas_setters() -> tuple[ctypes._CFuncPtr, ...]:
    """The thread-local setter of every OpenBLAS loaded in this process (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return ()
    setters = []
    for path in sorted(paths):
        try:
            setters.append(getattr(ctypes.CDLL(path), SETTER))
        except (OSError, AttributeError):
            continue
    return tuple(setters)


def one_blas_thread() -> bool:
    """BLAS products called from this thread run on it alone; False where no OpenBLAS with a thread-local setting
    is loaded (nothing changed). A thread pool's initializer: numpy, and with it its BLAS, is loaded by then."""
    setters = _openblas_setters()
    for setter in setters:
        setter(ctypes.c_int(1))
    return bool(setters)
