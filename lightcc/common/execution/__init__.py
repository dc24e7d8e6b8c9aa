"""Execution: what every rank does with an agreed bucket.

``run.py`` is the door (plan once, strategy, agreement, handles); ``plan.py`` the per-bucket
decisions; ``host.py`` / ``host_ops.py`` / ``gpu.py`` the strategies for host and GPU memory;
``direct.py`` the blocking unnamed small allreduces checked and reduced on the calling thread;
``reduction.py`` what they share (scaling, reduction dtypes, NaN masks, labels); ``fusion.py``
bucket planning and the fusion buffer; ``group.py`` one process set's state.
"""
