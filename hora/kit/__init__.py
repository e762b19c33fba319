"""The binding kit: what every framework binding shares, written once on NumPy.

Conversion of an input and the handle post-processing (:mod:`~hora.kit.frontend`), a training step's
collectives (:mod:`~hora.kit.gradients`), packing small tensors into one host call (:mod:`~hora.kit.packing`),
stateful compression (:mod:`~hora.kit.compressors`), the Keras callbacks' arithmetic
(:mod:`~hora.kit.schedules`) and Adasum's packing limit (:mod:`~hora.kit.adasum`). It stands on
:mod:`hora.core`'s public API; a binding adds only its framework's conversion.
"""
