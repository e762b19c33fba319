"""An elastic PyTorch job written the way Horovod users write one (``import horovod.torch as hvd``).

    horovodrun -np 1 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh python hvd_torch_elastic.py HOSTS

``HOSTS`` is the file the discovery script prints. The job starts on one worker; after its first commits
rank 0 writes ``localhost:2`` into it, the driver notices, the training resets at the next commit
(``HostsUpdatedInterrupt``) and carries on with two workers from the committed state. Each worker prints the
sizes it trained at; the job ends after some steps at size 2 (and fails if it never grew).
"""

import sys

import torch
import torch.nn.functional as F

import horovod.torch as hvd

HOSTS = sys.argv[1]
STEPS_AT_TWO = 20
MAX_STEPS = 5000  # a bound, not a wait: the job fails if the second worker never joins

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
target = torch.tensor([[1.0, -2.0, 3.0, 0.5]])


@hvd.elastic.run
def train(state):
    while state.steps_at_two < STEPS_AT_TWO:
        assert state.step < MAX_STEPS, "the job never grew to two workers"
        x = torch.randn(8, 4)
        optimizer.zero_grad()
        F.mse_loss(model(x), x @ target.t()).backward()
        optimizer.step()
        state.step += 1
        state.sizes = sorted(set(state.sizes) | {hvd.size()})
        if hvd.size() == 2:
            state.steps_at_two += 1
        if state.step == 3 and hvd.rank() == 0:
            with open(HOSTS, "w") as f:
                f.write("localhost:2\n")
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, step=0, steps_at_two=0, sizes=[])
train(state)
weights = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0))
assert all(torch.equal(weights[0], w) for w in weights), "the workers' models differ"
print(f"elastic done on rank {hvd.rank()} of {hvd.size()}, sizes {state.sizes}, steps {state.step}", flush=True)
