"""Observability: the Chrome/Perfetto timeline (timeline.py, a ``tracing.Tracer``) and fault
injection for tests (faults.py, ``LCC_FAULTS``)."""
