"""MXNet defect Horovod's suite found (issue 24): alltoall with float splits raises, as in Horovod.
Runs in .venv-mxnet (make setup-mxnet); skipped where MXNet is not installed."""

import pytest

mx = pytest.importorskip("mxnet")


def _float_splits():
    import mxnet as mx
    import numpy as np
    from mxnet.base import MXNetError

    import hora.mxnet as hvd

    hvd.init()
    size = hvd.size()
    tensor = mx.nd.array(np.arange(size, dtype=np.float32))
    try:
        hvd.alltoall(tensor, mx.nd.ones([size], dtype="float32"))
    except (MXNetError, ValueError) as e:
        assert "splits must hold integers" in str(e), e
    else:
        raise AssertionError("alltoall accepted float splits")
    out, received = hvd.alltoall(tensor, mx.nd.ones([size], dtype="int32"))  # int32 splits still work
    return received.asnumpy().tolist()


@pytest.mark.timeout(120)
def test_alltoall_refuses_float_splits():
    from harness import run

    assert run(2, _float_splits) == [[1, 1], [1, 1]]
