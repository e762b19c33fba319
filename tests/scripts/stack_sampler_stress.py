"""Sample the main thread's stack from another thread in a tight loop while the main thread works
(tests/test_main_stack.py; hora.engine.stacks says why).

    python tests/scripts/stack_sampler_stress.py new|old python|compile|loader|tf SECONDS

``new`` samples with hora.engine.callsite.main_thread (faulthandler's walk); ``old`` with the walk of frame
objects hora used before (sys._current_frames() and f_back), which, under ``tf`` (TensorFlow's tf.function and
GradientTape on the main thread), died with SIGSEGV in 2 of 4 runs of 60 s on CPython 3.11.7 (the other two
hung): the crash of the test suite's pool worker, reproduced."""
import sys
import threading
import time

walk, load, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])


def old_main_thread():  # hora's callsite.main_thread before this change
    f = sys._current_frames().get(threading.main_thread().ident)
    out = []
    while f is not None and len(out) < 6:
        top = (f.f_globals.get("__name__") or "").partition(".")[0]
        if top not in ("hora", "torch", "numpy", "tensorflow"):
            out.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_qualname))
        f = f.f_back
    return out


if walk == "new":
    from hora.engine import callsite
    sample = callsite.main_thread
else:
    sample = old_main_thread

stop = threading.Event()
count = [0]
errors = []


def sampler() -> None:
    while not stop.is_set():
        try:
            sample()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
        count[0] += 1


def deep(n):
    if n == 0:
        g = (i for i in range(3))
        next(g)
        try:
            raise ValueError("x")
        except ValueError:
            return sum(g)
    return deep(n - 1)


if load == "tf":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    v = tf.Variable(tf.ones([4, 4]))

    def step():
        @tf.function
        def f(x):
            return tf.reduce_sum(tf.matmul(x, v))
        with tf.GradientTape() as tape:
            y = f(tf.ones([2, 4]))
        tape.gradient(y, v)
elif load == "loader":
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(64, 4))

    def step():
        for _ in DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork"):
            deep(3)
elif load in ("compile", "torch"):
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    run = torch.compile(model, backend="aot_eager") if load == "compile" else model
    x = torch.randn(16, 4)
    run(x).sum().backward()  # compile before sampling starts

    def step():
        run(x).sum().backward()
        deep(5)
else:
    def step():
        deep(30)

sys.setswitchinterval(1e-5)
t = threading.Thread(target=sampler, daemon=True)
t.start()
end = time.monotonic() + seconds
steps = 0
while time.monotonic() < end:
    step()
    steps += 1
stop.set()
t.join()
print(f"walk={walk} load={load}: {steps} steps, {count[0]} samples, {len(errors)} errors {errors[:3]}")
