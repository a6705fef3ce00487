# Usage (device): python3 tests/gpu/slot_write_bench.py
# How fast can a read expert reach a slot that the GPU then computes on? Slot arrays shaped like
# one Qwen3-30B-A3B MoE layer (32 slots, 4-bit), 4 experts written per round into random slots,
# then a kernel reads every written row (as the next step's gather does). Milliseconds per expert
# for each way of writing; "none" is the kernel alone.
import ctypes, time
import mlx.core as mx, numpy as np

SLOTS, K, ROUNDS = 32, 4, 40
shapes = [(768, 256, "u4"), (768, 32, "bf"), (768, 32, "bf"),   # gate: weight, scales, biases
          (768, 256, "u4"), (768, 32, "bf"), (768, 32, "bf"),   # up
          (2048, 96, "u4"), (2048, 12, "bf"), (2048, 12, "bf")] # down
dt = {"u4": mx.uint32, "bf": mx.bfloat16}
arrays = [mx.zeros((SLOTS, a, b), dtype=dt[d]) for a, b, d in shapes]
mx.eval(arrays)
raws = [a.reshape(SLOTS, -1).view(mx.uint8) for a in arrays]
mx.eval(raws)
views = [np.array(r, copy=False) for r in raws]
row_bytes = [v.shape[1] for v in views]
print("expert bytes", sum(row_bytes))
rng = np.random.default_rng(0)
staging = [np.asarray(rng.integers(0, 255, (K, n)), dtype=np.uint8) for n in row_bytes]

maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l})
print("mapped:", maps)
drv = ctypes.CDLL("libcuda.so.1")
ctx, stream = ctypes.c_void_p(), ctypes.c_void_p()
assert drv.cuInit(0) == 0
assert drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert drv.cuCtxSetCurrent(ctx) == 0
assert drv.cuStreamCreate(ctypes.byref(stream), 1) == 0  # non-blocking
drv.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
drv.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
drv.cuStreamSynchronize.argtypes = [ctypes.c_void_p]

def use(slots):
    idx = mx.array(slots.astype(np.uint32))
    mx.eval([mx.sum(a[idx].astype(mx.float32)) for a in arrays])

def staged(slots):
    for v, block in zip(views, staging):
        for i, s in enumerate(slots):
            v[s] = block[i]

def copy(slots):
    where = mx.array(slots.astype(np.uint32))
    for a, block, (r, c, d) in zip(arrays, staging, shapes):
        a[where] = mx.array(block).view(dt[d]).reshape(K, r, c)
    mx.eval(arrays)

def memcpy(slots):
    for v, block in zip(views, staging):
        base = v.__array_interface__["data"][0]
        for i, s in enumerate(slots):
            err = drv.cuMemcpyHtoDAsync_v2(base + int(s) * v.shape[1], block[i].ctypes.data, v.shape[1], stream)
            assert err == 0, err
    assert drv.cuStreamSynchronize(stream) == 0

# The memcpy ways first: the others leave written pages on the host.
methods = {"none": lambda s: None, "memcpy-pageable": memcpy,
           "memcpy-pinned": memcpy,  # the staging blocks get registered before this one
           "staged": staged, "copy": copy}
for name, fn in methods.items():
    if name == "memcpy-pinned":
        for b in staging:
            assert drv.cuMemHostRegister_v2(b.ctypes.data, b.nbytes, 0) == 0
    times = []
    for r in range(ROUNDS):
        slots = rng.choice(SLOTS, K, replace=False)
        t = time.perf_counter(); fn(slots); use(slots); times.append(time.perf_counter() - t)
    ok = all(np.array_equal(np.array(arrays[j].reshape(SLOTS, -1).view(mx.uint8))[s], staging[j][i]) for j in range(len(raws)) for i, s in enumerate(slots)) if name != "none" else True
    print(f"{name:16s} {np.median(times[5:]) * 1e3 / K:7.3f} ms per expert (median of {ROUNDS - 5}), bytes landed: {ok}")
