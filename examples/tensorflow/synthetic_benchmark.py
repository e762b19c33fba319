"""Training throughput on random data, with flags like Horovod's TensorFlow 2 synthetic benchmark.

    hora run -np 2 python examples/tensorflow/synthetic_benchmark.py --num-iters 5
    hora run -np 2 python examples/tensorflow/synthetic_benchmark.py --model ResNet50 --image-size 64

``--model`` is ``mlp`` or ``cnn`` (small, defined here, so that the default runs on CPUs) or the name of a
``keras.applications`` model (``ResNet50``, Horovod's default, built without weights). Each step is a
``DistributedGradientTape`` in a ``tf.function`` (``--eager`` for none): one host call for the step's
gradients. Reports images per second per worker and in total.
"""

import argparse
import os
import statistics
import timeit

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402

CLASSES = 1000


def mlp(size):
    return keras.Sequential([keras.Input((size, size, 3)), keras.layers.Flatten(),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def cnn(size):
    return keras.Sequential([keras.Input((size, size, 3)), keras.layers.Conv2D(32, 5, padding="same",
                                                                               activation="relu"),
                             keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 5, padding="same", activation="relu"),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def build(name, size):
    if name in ("mlp", "cnn"):
        return {"mlp": mlp, "cnn": cnn}[name](size)
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=CLASSES)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    p.add_argument("--bf16-allreduce", action="store_true", help="send gradients as bfloat16 (hora only)")
    p.add_argument("--model", default="mlp", help="mlp, cnn or a keras.applications model such as ResNet50")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches, not timed")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per timed iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of timed iterations")
    p.add_argument("--eager", action="store_true", help="run the steps eagerly, not in a tf.function")
    p.add_argument("--no-cuda", action="store_true", help="stay on the CPU even when a GPU is visible")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    gpus = [] if args.no_cuda else tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    else:
        tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
        tf.config.threading.set_inter_op_parallelism_threads(1)

    model = build(args.model, args.image_size)
    opt = keras.optimizers.SGD(0.01 * hvd.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = (hvd.Compression.fp16 if args.fp16_allreduce else
                   hvd.Compression.bf16 if args.bf16_allreduce else hvd.Compression.none)
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], maxval=CLASSES, dtype=tf.int64)

    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    step = step if args.eager else tf.function(step)

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    device = "GPU" if gpus else "CPU worker"
    workers = f"{hvd.size()} {device}{'s' if hvd.size() > 1 else ''}"
    log(f"Model: {args.model}, batch size {args.batch_size} per worker, {args.image_size}x{args.image_size} "
        f"images, {len(model.trainable_variables)} gradient tensors, {workers}")
    step(True)
    log("Warming up...")
    timeit.timeit(lambda: step(False), number=args.num_warmup_batches)
    log("Timing...")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(lambda: step(False), number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{i}: {rates[-1]:.1f} img/sec per worker")
    mean = statistics.fmean(rates)
    spread = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    log(f"Img/sec per worker: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {workers}: {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
