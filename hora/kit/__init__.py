"""The binding kit: what every framework binding shares, written once on NumPy.

Conversion of an input and the handle post-processing (:mod:`~hora.kit.frontend`), a training step's
collectives (:mod:`~hora.kit.gradients`), packing small tensors into one host call (:mod:`~hora.kit.packing`),
stateful compression (:mod:`~hora.kit.compressors`), the Keras callbacks' arithmetic
(:mod:`~hora.kit.schedules`), Adasum's packing limit (:mod:`~hora.kit.adasum`), and the sharded optimizer's
layout and collectives (:mod:`~hora.kit.sharding`) and state at rest and in motion
(:mod:`~hora.kit.shard_state`). It stands on :mod:`hora.core`'s public API; a binding adds only its framework's
conversion.
"""
