# On PYTHONPATH beside the checkout, logs every garbage collection of a `tierspec serve` process to /tmp/s74/gc_PID.log
# (time, generation, duration): `PYTHONPATH=DIR_OF_THIS_AS_sitecustomize.py:CHECKOUT python benchmarks/serve_load.py --concurrency 1,8`.
import gc, os, time, sys
if 'serve' in sys.argv:
    _t = [0.0]
    _f = open(f'/tmp/s74/gc_{os.getpid()}.log', 'a', buffering=1)
    def _cb(phase, info):
        if phase == 'start': _t[0] = time.perf_counter()
        else: _f.write(f"{time.time():.3f} gen{info['generation']} {1e3*(time.perf_counter()-_t[0]):.3f}ms collected={info['collected']}\n")
    gc.callbacks.append(_cb)
