"""The local-process backend (``epdctl up``): pools of ``epdctl serve`` processes, the reconcile
pass and run loop on them, and the start-up CPU priority of new engines."""
