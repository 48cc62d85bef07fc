"""The op interface between the executor and a backend's kernels (docs/kernels.md).

Low in the architecture map on purpose: the executor's blocks call ops through ``Backend``
(``contract.py``) and hand routed experts over as ``ExpertWeight`` (``expert_weight.py``); the
backends themselves, their loader and the conformance runner sit above the executor
(``k3bundle.kernels``). Each block module keeps the reference form of its own ops next to its
equations, so the reference is the executor and nothing here imports it.
"""
