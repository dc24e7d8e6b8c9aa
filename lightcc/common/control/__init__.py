"""The control plane: which collectives every rank runs, in which order.

``messages.py`` the wire encoding (requests, responses, batches); ``controller.py`` rank 0's
coordinator, pure logic testable without MPI, and ``checks.py`` its cross-rank validation;
``cache.py`` the response cache (repeated requests become small ids); ``tree.py`` /
``negotiator.py`` the control tree's bit vectors and one rank's node in it; ``transport.py``
the TCP star/tree the messages travel on; ``link.py`` the engine's side of all this. Nothing
here moves tensor data or imports MPI or CuPy.
"""
